"""Every repository path and command the docs name exists: a file or folder of the tree in backticks,
a `python -m bench COMMAND`, a `prefillshare COMMAND` and a `bash scripts/...` or `bash bench/...`
script. A renamed module or a removed subcommand fails here, naming the page and the line."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").glob("*.md")])
# a path of the tree: starts with one of its top-level folders and names a file or folder
TOP = ("app", "deployments", "agents", "bench", "tests", "scripts", "k8s", "docs", "checkpoints", "examples", ".ci")
PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./\-{},*]*)")
COMMAND = re.compile(r"python -m bench ([a-z][\w-]*)|(?<![\w/.-])prefillshare ([a-z][\w-]*)")


def _expand(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [n for alt in m[1].split(",") for n in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _exists(ref: str) -> bool:
    ref = ref.rstrip(".,;:")
    for name in _expand(ref):
        name = name.split("::")[0]
        if "*" in name:
            if not list(REPO.glob(name)):
                return False
        elif not (REPO / name).exists():
            module, _, attr = name.rpartition(".")  # a module's name: `tests/hang_report.bounded`
            if not (attr.isidentifier() and (REPO / (module + ".py")).is_file()):
                return False
    return True


def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction)  # noqa: SLF001
            for name in a.choices}


def _bench_commands() -> set[str]:
    from bench.__main__ import build_parser

    return _subcommands(build_parser([]))


def _cli_commands() -> set[str]:
    from prefillshare.app.cli import build_parser

    return _subcommands(build_parser([]))


def _refs(pattern: re.Pattern) -> list[tuple[str, int, re.Match]]:
    out = []
    for page in PAGES:
        for i, line in enumerate(page.read_text().splitlines(), 1):
            out += [(page.relative_to(REPO).as_posix(), i, m) for m in pattern.finditer(line)]
    return out


def test_every_path_the_docs_name_exists():
    missing = [f"{page}:{line}: {m[1]}" for page, line, m in _refs(PATH)
               if "results" not in m[1] or m[1].startswith("docs/results")
               if not _exists(m[1]) and "<" not in m[1]]
    # the CHANGELOG is history: it may name what is gone
    missing = [x for x in missing if not x.startswith("CHANGELOG.md")]
    assert not missing, "\n".join(missing)


def test_every_bench_and_cli_command_the_docs_name_exists():
    bench, cli = _bench_commands(), _cli_commands()
    missing = []
    for page, line, m in _refs(COMMAND):
        if page == "CHANGELOG.md":
            continue
        if m[1] and m[1] not in bench:
            missing.append(f"{page}:{line}: python -m bench {m[1]}")
        if m[2] and m[2] not in cli:
            missing.append(f"{page}:{line}: prefillshare {m[2]}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("ref, ok", [("app/plan.py", True), ("app/no_such_module.py", False),
                                     ("docs/results/overload_10min.{md,json}", True),
                                     ("docs/results/overload_10min.{md,nope}", False),
                                     ("tests/test_plan.py::test_x", True)])
def test_the_path_check_can_fail(ref, ok):
    assert _exists(ref) is ok
