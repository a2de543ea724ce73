"""mypy over the library and the SDK at zero errors, with pyproject.toml's [tool.mypy] baseline.

The names resolve on disk (src/prefillshare/ links to app/, deployments/ and agents/; the editable
install is a plain path), so mypy follows them as an editor does. Every module is checked: none is
exempted with ``ignore_errors`` or a blanket ``ignore_errors`` per file.
"""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("prefillshare.agents", "prefillshare.app", "prefillshare.deployments")


def _mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=900)


def test_mypy_finds_no_error_in_the_library_and_the_sdk():
    r = _mypy(*(a for p in PACKAGES for a in ("-p", p)))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "Success: no issues found" in r.stdout


def test_no_module_of_the_library_is_exempted():
    """Zero errors means every module: no override silences one, and no file opts out whole."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config.get("check_untyped_defs") is True
    exempted = [m for o in config.get("overrides", []) if o.get("ignore_errors") for m in o["module"]]
    assert exempted == [], exempted
    opted_out = [str(f.relative_to(ROOT)) for d in ("app", "deployments", "agents") for f in (ROOT / d).rglob("*.py")
                 if "# mypy: ignore-errors" in f.read_text()]
    assert opted_out == [], opted_out


def test_mypy_sees_an_error_and_names_resolve_on_disk(tmp_path):
    """The check can fail: a type error in a module that imports the library is reported, and the
    library's names resolve to their files (no import hook)."""
    bad = tmp_path / "uses_the_library.py"
    bad.write_text("from prefillshare.app.plan import AppPlan\n"
                   "from prefillshare.agents import Sampling\n"
                   "n: int = Sampling().temperature\n"
                   "AppPlan.decoder(1, 2)\n")
    r = _mypy(str(bad), cwd=tmp_path)
    assert r.returncode == 1, r.stdout
    assert "uses_the_library.py:3: error: Incompatible types in assignment" in r.stdout, r.stdout
    assert "uses_the_library.py:4: error" in r.stdout and "Cannot find implementation" not in r.stdout, r.stdout
