"""docs/results holds only the runs the docs cite, indexed in its README and small; no file of the
repository carries a machine's absolute path (a home or work folder, a log's site-packages path)."""
from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
MAX_BYTES = 1 << 20
# written split so that this file does not match itself
MACHINE_PATH = re.compile("(?<![\\w.~])/(?:" + "|".join(["wo" + "rk", "ho" + "me", "ro" + "ot", "Us" + "ers"]) + ")/")


def _expand(pattern: str) -> list[str]:
    """``a_{x,y}.{md,json}`` -> its names (shell brace expansion; ``*`` stays a glob)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [n for alt in m[1].split(",") for n in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _matches(patterns: list[str], name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for pat in patterns for p in _expand(pat))


def _index() -> list[tuple[list[str], str]]:
    """The README's rows: (file patterns, the page citing them)."""
    rows = []
    for line in (RESULTS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[2]))
    return rows


def _files() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")


def test_every_result_file_has_one_row_in_the_index_and_every_row_a_file():
    rows = _index()
    assert rows
    unlisted = [f for f in _files() if not any(_matches(pats, f) for pats, _ in rows)]
    assert not unlisted, f"add a row to docs/results/README.md (or remove the file): {unlisted}"
    for pats, _ in rows:
        for p in (n for pat in pats for n in _expand(pat)):
            assert any(fnmatch.fnmatchcase(f, p) for f in _files()), f"docs/results/README.md names {p}: no such file"


def test_every_result_file_is_cited_by_the_page_its_row_names():
    for pats, page in _index():
        text = (REPO / page).read_text()
        cited = [_expand(p) for p in re.findall(r"results/([\w{},.*]*[\w}])", text)]
        for f in _files():
            if _matches(pats, f):
                assert any(_matches(c, f) for c in cited), f"{page} does not cite docs/results/{f}"


def test_the_results_stay_small():
    total = sum(p.stat().st_size for p in RESULTS.iterdir())
    assert total < MAX_BYTES, f"docs/results is {total / 1e6:.2f} MB: keep reports, not per-request samples or logs"


def test_no_file_carries_a_machines_absolute_path():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    found = []
    for name in names.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file() or path.stat().st_size > 4 << 20:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary: weights, images
        found += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not found, found[:20]


def test_the_path_check_can_fail():
    assert MACHINE_PATH.search("  File \"/" + "home/me/site-packages/x.py\"")
    assert not MACHINE_PATH.search("~/.cache/vllm, /dev/shm/prefillshare, docs/results/x.json")
