"""The library's exceptions have one root (app/errors.py) and distinct names.

Read from the source (no import of vLLM or Ray): every class in app/ or deployments/ that derives,
directly or through another project class, from a builtin exception must also derive from
PrefillShareLibraryError. Private classes (``_Name``) are a module's own control flow, never raised
to a caller, and are left out.
"""
from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest

from prefillshare.app.errors import PrefillShareLibraryError

REPO = Path(__file__).resolve().parent.parent
ROOT = "PrefillShareLibraryError"
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _classes() -> dict[str, list[tuple[str, list[str]]]]:
    """Class name -> [(module, base names)] for every class defined in app/ and deployments/."""
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for top in ("app", "deployments"):
        for path in sorted((REPO / top).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                    found.setdefault(node.name, []).append((module, bases))
    return found


CLASSES = _classes()


def _ancestors(name: str, seen: frozenset = frozenset()) -> set[str]:
    out: set[str] = set()
    for _, bases in CLASSES.get(name, []):
        for b in bases:
            if b not in seen:
                out |= {b} | _ancestors(b, seen | {name})
    return out


EXCEPTIONS = sorted((name, module) for name, defs in CLASSES.items() for module, _ in defs
                    if name != ROOT and _ancestors(name) & (BUILTIN_EXCEPTIONS | {ROOT}))


def test_the_scan_finds_the_library_exceptions():
    names = {n for n, _ in EXCEPTIONS}
    assert {"ConfigError", "EngineError", "BlockMissing", "ApiError", "RenderError"} <= names
    assert len(names) >= 25


@pytest.mark.parametrize("name,module", [pytest.param(n, m, id=n) for n, m in EXCEPTIONS if not n.startswith("_")])
def test_every_library_exception_derives_from_the_root(name, module):
    assert ROOT in _ancestors(name), f"{module}.{name} does not derive from prefillshare.app.errors.{ROOT}"


def test_exception_names_are_unique_across_the_library():
    """One name, one class: ``except RenderError`` cannot mean two unrelated things."""
    twice = {n: [m for m, _ in CLASSES[n]] for n, _ in EXCEPTIONS if len(CLASSES[n]) > 1}
    assert not twice, twice


@pytest.mark.parametrize("module,name,builtin", [
    ("prefillshare.app.config", "ConfigError", ValueError),
    ("prefillshare.app.engine.pool.kv_pool", "BlockMissing", KeyError),
    ("prefillshare.app.engine.pool.kv_pool", "PoolMissing", FileNotFoundError),
    ("prefillshare.app.engine.nixl.kv_auth", "KVAuthError", PermissionError),
    ("prefillshare.app.engine.pool.slab", "SlotOutOfRange", LookupError),
    ("prefillshare.app.rendering", "RenderError", ValueError),
    ("prefillshare.app.kube.render", "RayServiceRenderError", ValueError),
    ("prefillshare.deployments.errors", "Shed", Exception),
])
def test_typed_subclasses_keep_their_builtin_base(module, name, builtin):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, PrefillShareLibraryError) and issubclass(cls, builtin)
    with pytest.raises(builtin):  # what caught it before still catches it
        raise cls("x")
