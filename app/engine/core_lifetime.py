"""An engine-core process dies with the process that started it, however that one ends.

vLLM runs each engine's core (and, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, its worker) in a
spawned child of the process that builds the ``AsyncLLM``: here a Ray Serve replica. vLLM stops
that child when the engine is shut down, and its own worker processes watch a death pipe, but
vLLM 0.32 ties the core to nothing: when the replica is killed outright (``ray stop``, Ray
killing a worker, SIGKILL, the OOM killer) the core, renamed ``VLLM::EngineCore``, lives on as an
orphan with its model and KV space in memory, and it ignores SIGTERM while it is busy.

:func:`install` wraps the core's spawn target (``EngineCoreProc.run_engine_core``, which vLLM
pickles by name into the child). In the child, before vLLM's own entry, a daemon thread waits on
the parent's multiprocessing sentinel (a pipe that reads EOF once the parent is gone) and on the
parent pid; when the parent is gone it kills the core's own descendants and then the core, with
SIGKILL. ``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that spawned the child
ends, and engines are built in worker threads (``asyncio.to_thread``).

The same hook keeps the core from leaving a named semaphore behind: in a spawned process
tqdm's first progress bar (vLLM's weight loading) makes a multiprocessing RLock, a
``/dev/shm/sem.mp-*`` file that only a clean exit unlinks, so every SIGKILLed core left one (seen
here: one per killed core, none after clean stops). The core's bars all run in its own process, so
:func:`_thread_lock_for_progress_bars` gives tqdm a thread lock instead.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait

__all__ = ["install", "run_engine_core"]

_POLL_S = 1.0
_vllm_run_engine_core = None  # vLLM's own entry, saved where install() replaced it


def install() -> None:
    """Make every engine core this process spawns from now on die with it (idempotent)."""
    global _vllm_run_engine_core
    from vllm.v1.engine.core import EngineCoreProc

    current = EngineCoreProc.__dict__["run_engine_core"]
    if getattr(current, "__func__", None) is run_engine_core:
        return
    _vllm_run_engine_core = current.__func__
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core)


def run_engine_core(*args, **kwargs):
    """The core's entry in the spawned child: start the parent watch, then run vLLM's entry."""
    _watch_parent()
    _thread_lock_for_progress_bars()
    entry = _vllm_run_engine_core
    if entry is None:  # a fresh child: vLLM's class still holds its own entry
        from vllm.v1.engine.core import EngineCoreProc

        entry = EngineCoreProc.run_engine_core
    try:
        return entry(*args, **kwargs)
    finally:
        # vLLM's teardown has run and ended in a full gc.collect(); the interpreter's exit would scan
        # the whole heap once more (~1.5 s here), and vLLM's parent SIGKILLs a core still alive 5 s
        # after its SIGTERM. Frozen, the objects are freed by the exit without that scan.
        gc.freeze()


def _thread_lock_for_progress_bars() -> None:
    """tqdm.set_lock before any bar: tqdm then never creates its multiprocessing lock."""
    from tqdm import tqdm  # a dependency of vLLM itself

    tqdm.set_lock(threading.RLock())


def _watch_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing: the pid is all there is to watch
        parent_pid, sentinels = os.getppid(), []
    else:
        parent_pid, sentinels = parent.pid or os.getppid(), [parent.sentinel]

    def watch() -> None:
        while os.getppid() == parent_pid:
            if sentinels and wait(sentinels, timeout=_POLL_S):
                break  # EOF on the parent's pipe: the parent is gone (or dropped this child)
            if not sentinels:
                time.sleep(_POLL_S)
        _kill_self_and_descendants()

    threading.Thread(target=watch, name="engine-core-parent-watch", daemon=True).start()


def _kill_self_and_descendants() -> None:
    import psutil

    try:
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
