"""What a test session left in /dev/shm: entries that appeared while it ran and are still there at its end.

/dev/shm is shared by everything on the machine and its entries do not say who made them. An entry
counts as this session's leftover when it appeared after the session began and no other test
session ran meanwhile; with another session seen (at the start or at the end) the new entries may
be that one's pools, so they are reported but not blamed, except under ``CI=true`` where a job runs
alone.

Residues of a process killed mid-way are told apart: CPython's multiprocessing semaphores
(``sem.mp-*``, unlinked at a clean exit) and shared-memory segments (``psm_*``: vLLM makes one,
and a semaphore, while an engine starts) that no live process maps. The fault tests kill engines
on purpose, as a crash would, and Serve's shutdown may stop a replica that Serve is restarting;
such residues are removed and reported with the test they appeared during, but fail no run.
The project's own clean stop and a SIGKILLed replica leave none: tests/test_serve_cli.py and
tests/test_serve_stop.py assert that on their own paths.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import psutil

# the folder watched; tests of this check (tests/test_suite_hygiene.py) point it at a folder of their own
SHM = Path(os.environ.get("PREFILLSHARE_SHM_WATCHED", "/dev/shm"))


def snapshot(root: Path | None = None) -> set[str]:
    try:
        return set(os.listdir(root or SHM))
    except OSError:
        return set()


def leftovers(before: set[str], root: Path | None = None, grace_s: float = 2.0) -> list[str]:
    """Entries not in ``before`` still there after at most ``grace_s`` (a process that is stopping may
    still be removing its own)."""
    deadline = time.monotonic() + grace_s
    while True:
        new = sorted(snapshot(root) - before)
        if not new or time.monotonic() >= deadline:
            return new
        time.sleep(0.5)


RESIDUE_PREFIXES = ("sem.mp-", "psm_")


def residues(names: list[str], root: Path | None = None) -> list[str]:
    """The multiprocessing semaphores and shared-memory segments among ``names`` that no live
    process maps (their makers are gone)."""
    candidates = [n for n in names if n.startswith(RESIDUE_PREFIXES)]
    if not candidates:
        return []
    paths = {str((root or SHM) / n): n for n in candidates}
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        mapped.update(n for path, n in paths.items() if path in text)
    return [n for n in candidates if n not in mapped]


def made_at(name: str, root: Path | None = None) -> float | None:
    """When the entry appeared (its change time; wall clock), None if it is gone."""
    try:
        return os.stat((root or SHM) / name).st_ctime
    except OSError:
        return None


def remove(names: list[str], root: Path | None = None) -> None:
    for name in names:
        path = (root or SHM) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def other_sessions(marker: tuple[str, str]) -> list[psutil.Process]:
    """Processes of another test session: they carry the marker variable with another value and are
    not this process's ancestors (a session that runs this one, as tests/test_suite_hygiene.py does)."""
    key, value = marker
    ancestors = {p.pid for p in psutil.Process().parents()}
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid not in ancestors and p.environ().get(key) not in (None, value):
                found.append(p)
        except psutil.Error:
            pass
    return found
