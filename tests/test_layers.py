"""The layers import one way: bench/ and tests/ drive deployments/, which builds on app/.

app/ is the library (config, plan, engine, models, training, rendering); deployments/ holds the
Ray Serve classes. An import of deployments from app/ (even inside a function) would make the
plan depend on the deployments it configures. bench/ (benchmarks and checks, not installed) and
tests/ sit on top: nothing below them imports them, and nothing outside tests/ imports tests/.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each absolute import in ``path``, the project's own named by folder
    (``prefillshare.app.plan`` -> ``app.plan``, as the tree lays it out)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(line, m.removeprefix("prefillshare.")) for line, m in out]


def test_app_imports_nothing_from_deployments():
    offenders = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        offenders += [f"{rel}:{line} imports {m}" for line, m in _imports(path)
                      if m == "deployments" or m.startswith("deployments.")]
    assert not offenders, offenders


SDK_IMPORTS = {"httpx"}  # pyproject.toml's base dependencies: what `pip install prefillshare` brings


def test_the_sdk_imports_only_the_standard_library_and_httpx():
    """agents/ is the SDK an agent application installs alone (docs/sdk.md): it imports nothing of
    the server (app/, deployments/) and no package outside the standard library but httpx."""
    import sys

    offenders = []
    for path in sorted((ROOT / "agents").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        offenders += [f"{rel}:{line} imports {m}" for line, m in _imports(path)
                      if m.split(".")[0] not in sys.stdlib_module_names | SDK_IMPORTS | {"__future__"}]
    assert not offenders, offenders


def test_the_scan_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from prefillshare.deployments.ingress.server import Router\n    import prefillshare.deployments.messages\n")
    assert [m for _, m in _imports(f)] == ["deployments.ingress.server", "deployments.messages"]


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


def _handover_mentions(path: Path) -> list[str]:
    """Where ``path`` reads the hand-over mode: a "vllm-nixl" string constant (docstrings aside) or
    an attribute ``.handover`` of a config (``cfg.handover``)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and n.value == "vllm-nixl" and id(n) not in docstrings:
            out.append(f"{n.lineno}: 'vllm-nixl'")
        elif isinstance(n, ast.Attribute) and n.attr == "handover" and isinstance(n.value, ast.Name) \
                and n.value.id in ("cfg", "config", "app_config"):
            out.append(f"{n.lineno}: {n.value.id}.handover")
    return out


def test_the_hand_over_mode_is_read_only_by_the_config_and_the_plan():
    """The plan chooses the app's Handover once (app/engine/modes.py, for the plan); replicas and everything else
    ask that object and never re-derive the mode (issue 45)."""
    allowed = {"app/config.py", "app/engine/modes.py"}
    found = {}
    for pkg in ("app", "deployments"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in allowed:
                continue
            hits = _handover_mentions(path)
            if hits:
                found[rel] = hits
    assert not found, found
    assert _handover_mentions(ROOT / "app" / "engine" / "modes.py")  # the scan sees the one reader


def test_the_request_path_below_the_ingress_imports_nothing_of_it():
    """deployments/ reads top to bottom (docs/DESIGN.md): ingress/ calls path/, replicas/ and
    routing/; none of those imports ingress/ (what both need is in deployments/ itself)."""
    offenders = []
    for pkg in ("path", "replicas", "routing"):
        for path in sorted((ROOT / "deployments" / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            offenders += [f"{rel}:{line} imports {m}" for line, m in _imports(path)
                          if m.startswith("deployments.ingress")]
    assert not offenders, offenders


MODE_PACKAGES = ("app.engine.pool", "app.engine.nixl")


RAY_ON_THE_PATH = {"deployments/path/serve_engines.py", "deployments/path/orchestrator.py"}


def test_the_path_below_the_ingress_runs_without_ray_but_where_docs_design_says():
    """docs/DESIGN.md: path/ has no Ray but in serve_engines.py (Serve handles) and orchestrator.py
    (a Serve deployment); the others, and what they import of the project, run in a plain process
    (the fan-out and decode-call tests do)."""
    def project_file(m: str) -> Path | None:
        base = ROOT / m.replace(".", "/")
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)

    offenders = []
    for path in sorted((ROOT / "deployments" / "path").glob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in RAY_ON_THE_PATH:
            continue
        seen, todo = set(), [path]
        while todo:
            f = todo.pop()
            if f in seen:
                continue
            seen.add(f)
            for line, m in _imports(f):
                if m == "ray" or m.startswith("ray."):
                    offenders.append(f"{rel} -> {f.relative_to(ROOT).as_posix()}:{line} imports {m}")
                elif m.startswith(("app.", "deployments.")) and (target := project_file(m)) is not None:
                    todo.append(target)
    assert not offenders, offenders
    assert any(m.startswith("ray") for _, m in _imports(ROOT / "deployments/path/serve_engines.py"))  # it sees Ray


def test_only_the_registry_and_the_modes_own_packages_import_a_mode():
    """A hand-over mode (app/engine/pool/, app/engine/nixl/) is reached through the registry
    (app/engine/modes.py) and the Handover seam; nothing else in app/ or deployments/ imports it."""
    offenders = []
    for top in ("app", "deployments"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            own = next((m for m in MODE_PACKAGES if rel.startswith(m.replace(".", "/") + "/")), None)
            if rel == "app/engine/modes.py" or own:
                continue
            offenders += [f"{rel}:{line} imports {m}" for line, m in _imports(path)
                          if m.startswith(MODE_PACKAGES)]
    assert not offenders, offenders


# the seam and the request path name no mode's nouns: a mode's per-prompt value is a HandOff
SEAM = ("app/engine/handover.py", "deployments/messages.py", "deployments/metrics.py", "deployments/path",
        "deployments/replicas", "deployments/ingress", "deployments/routing")
MODE_NOUNS = re.compile(r"(^|_)leases?($|_)|nixl|pool_path", re.IGNORECASE)


def _identifiers(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every name the code defines or reads: functions, classes, arguments,
    attributes, variables; not strings, comments or docstrings."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = (node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else
                node.arg if isinstance(node, ast.arg) else node.attr if isinstance(node, ast.Attribute) else
                node.id if isinstance(node, ast.Name) else None)
        if name is not None:
            out.append((node.lineno, name))
    return out


def test_the_seam_and_the_request_path_name_no_mode_nouns():
    offenders = []
    for part in SEAM:
        target = ROOT / part
        for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            rel = path.relative_to(ROOT).as_posix()
            offenders += [f"{rel}:{line} {name}" for line, name in _identifiers(path) if MODE_NOUNS.search(name)]
    assert not offenders, offenders
    # the scan sees a mode's noun where one is
    assert any(MODE_NOUNS.search(n) for _, n in _identifiers(ROOT / "app/engine/nixl/handover.py"))


def test_the_registry_names_every_mode_the_config_allows():
    import typing

    from prefillshare.app.config import AppConfig
    from prefillshare.app.engine.modes import MODES

    allowed = set(typing.get_args(AppConfig.model_fields["handover"].annotation))
    assert set(MODES) == allowed, (set(MODES), allowed)


def test_no_import_cycle_between_modules():
    """app/ and deployments/ import each other's modules without a cycle (imports inside functions
    included: a cycle there still ties the two modules' lifetimes together)."""
    import graphlib

    modules = {}
    for pkg in ("app", "deployments"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
            modules[name] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for _, m in _imports(path):
            target = next((c for c in (m, m.rsplit(".", 1)[0]) if c in modules and c != name), None)
            if target and not name.startswith(target + ".") and target != name.rsplit(".", 1)[0]:
                graph[name].add(target)
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def test_no_function_is_longer_than_80_lines():
    """A function that does not fit on a screen hides the path of a request (issue 45)."""
    long = []
    for pkg in ("app", "deployments", "agents"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for n in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > 80:
                    long.append(f"{path.relative_to(ROOT).as_posix()}:{n.lineno} {n.name}")
    assert not long, long


def test_nothing_below_bench_and_tests_imports_them():
    """app/, deployments/ and the SDK never import bench/ or a tests/ module; bench/ and scripts/
    never import a tests/ module (bench/random_models.py is where shared test-bed helpers live)."""
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests"}
    offenders = []
    for pkg, banned in (("app", {"bench"}), ("deployments", {"bench"}), ("agents", {"bench"}), ("bench", set()),
                        ("scripts", set())):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, m in _imports(path):
                top = m.split(".")[0]
                if top in banned or top in test_modules:
                    offenders.append(f"{rel}:{line} imports {m}")
    assert not offenders, offenders
