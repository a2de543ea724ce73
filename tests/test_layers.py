"""The layers import one way: deployments/ builds on app/, never the reverse.

app/ is the library (config, plan, engine, models, training, rendering); deployments/ holds the
Ray Serve classes. An import of deployments from app/ (even inside a function) would make the
plan depend on the deployments it configures. The benchmark harness (app/bench) drives the
deployed app end to end and is the one part of app/ that may start it.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVERS = ("app/bench/",)  # benchmark drivers: they start the Serve app and time its deployments


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def test_app_imports_nothing_from_deployments():
    offenders = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(DRIVERS):
            continue
        offenders += [f"{rel}:{line} imports {m}" for line, m in _imports(path)
                      if m == "deployments" or m.startswith("deployments.")]
    assert not offenders, offenders


def test_the_scan_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from deployments.router import Router\n    import deployments.messages\n")
    assert [m for _, m in _imports(f)] == ["deployments.router", "deployments.messages"]


def test_every_module_has_its_line_in_the_design_map():
    """docs/DESIGN.md's layout names every module (by file name, in its package's part of the map)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    block = text[text.index("## Layout"):text.index("## Hand-over convention")]
    missing = []
    for pkg in ("app", "deployments", "agents"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            if path.name not in block:
                missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"add these to docs/DESIGN.md's layout: {missing}"
