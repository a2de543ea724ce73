"""A serving engine yields the CPU to an engine that is starting.

On a node whose engines share cores (every CPU deployment here), a replica that Serve restarts
after a crash needs ~40 CPU-s to import vLLM, load weights and build its engine, while the
engines still serving keep every core busy under load: the restart then stretched to ~150 s
(docs/reliability.md "Across nodes"), and the restarted decoder's requests failed as
``decoder_unavailable`` all that time. Once an engine answers, :func:`renice_tree` raises the
niceness of its core processes (every thread, every descendant), so a starting engine, still at
the niceness it was spawned with, gets the larger CPU share; engines at the same niceness share
as before, so a node whose engines all serve runs as it did. Raising one's own niceness needs no
privilege (a pod without CAP_SYS_NICE can do it); nothing here lowers it.
"""
from __future__ import annotations

import contextlib
import os

__all__ = ["renice_tree", "niceness_of"]


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def renice_tree(pid: int, niceness: int) -> int:
    """Set ``niceness`` on every thread of ``pid`` and of its descendants (Linux niceness is per
    thread: a thread made later inherits its creator's). Never lowers a thread's niceness.
    Returns how many threads were changed."""
    changed = 0
    for proc in [pid, *_descendants(pid)]:
        for tid in _threads(proc):
            with contextlib.suppress(ProcessLookupError, PermissionError):  # gone meanwhile / not ours
                if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                    os.setpriority(os.PRIO_PROCESS, tid, niceness)
                    changed += 1
    return changed


def niceness_of(pid: int) -> list[int]:
    """The niceness of each thread of ``pid`` (for checks and tests)."""
    out = []
    for tid in _threads(pid):
        with contextlib.suppress(ProcessLookupError):
            out.append(os.getpriority(os.PRIO_PROCESS, tid))
    return out
