"""Which processes a test started, found by ancestry and inheritance, never by command line.

vLLM renames its engine cores (``VLLM::EngineCore``) and an orphan loses its parent, so neither a
command line nor the process tree at the end says what a test started. A :class:`ProcessTracker`
samples the descendants of one root process about once a second, by pid and start time (so a
process orphaned later is still known, and a reused pid is not mistaken for it); an explicit
:meth:`sample` and :meth:`stop` also take every process whose environment carries a marker that
the root's children inherit (so one orphaned between samples is found too; reading every
process's environment is too costly to do each second on a shared machine).
"""
from __future__ import annotations

import threading

import psutil

SAMPLE_S = 1.0


class ProcessTracker:
    def __init__(self, root: psutil.Process, marker: tuple[str, str] | None = None):
        self.root, self.marker = root, marker
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-tracker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample(by_marker=False)

    def sample(self, by_marker: bool = True) -> None:
        procs = []
        try:
            procs = self.root.children(recursive=True)
        except psutil.Error:
            pass
        if by_marker and self.marker is not None:
            key, value = self.marker
            for p in psutil.process_iter():
                try:
                    if p.pid != self.root.pid and p.environ().get(key) == value:
                        procs.append(p)
                except psutil.Error:
                    pass
        for p in procs:
            try:
                self.seen.setdefault((p.pid, p.create_time()), p)
            except psutil.Error:
                pass

    def running(self) -> list[psutil.Process]:
        """What was seen and still runs (the very process: same pid and start time, not a zombie)."""
        return [p for (_, started), p in list(self.seen.items()) if is_running(p, started)]

    def stop(self) -> list[psutil.Process]:
        """Stop sampling, take a last sample, and say what still runs."""
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.running()


def is_running(p: psutil.Process, started: float | None = None) -> bool:
    try:
        return (started is None or p.create_time() == started) and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def title(p: psutil.Process) -> str:
    """Its name and command line (a renamed process shows its title there)."""
    try:
        return f"{p.name()} [{' '.join(p.cmdline())[:120]}]"
    except psutil.Error:
        return "?"


def kill_all(procs: list[psutil.Process], grace_s: float = 0.0) -> None:
    """SIGTERM (with ``grace_s``) then SIGKILL each, by pid; waits for them to go."""
    if grace_s > 0:
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
