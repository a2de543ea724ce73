"""Suite-wide hygiene: nothing a test started outlives the session, and a leftover fails the run.

What a test starts is found by ancestry and inheritance, not by its command line (vLLM renames
its engine cores ``VLLM::EngineCore``): a sampler thread records every descendant of pytest, by
pid and start time, while the session runs, so a process orphaned later (its parent killed) is
still known at the end; and the session puts a marker in its environment, which every process
it starts inherits, so one orphaned before a sample is found too. At session end whatever of
those still runs is stopped by pid (SIGTERM, then SIGKILL) and named, and the session fails.
"""
from __future__ import annotations

import os
import sys
import threading
import uuid

import psutil
import pytest

_SAMPLE_S = 1.0
MARKER = "PREFILLSHARE_TEST_SESSION"


class _Descendants:
    """Every process seen below pytest during the session, keyed by (pid, start time)."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.marker = os.environ.setdefault(MARKER, uuid.uuid4().hex)
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conftest-descendants", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        try:
            children = self.me.children(recursive=True)
        except psutil.Error:
            return
        for p in children:
            try:
                self.seen.setdefault((p.pid, p.create_time()), p)
            except psutil.Error:
                pass

    def still_running(self) -> list[psutil.Process]:
        self._stop.set()
        self._thread.join()
        self.sample()
        self._inheritors()
        left = []
        for (_pid, started), p in self.seen.items():
            try:  # same pid and start time: the very process, not a reused pid
                if (p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
                        and not self._own_helper(p)):
                    left.append(p)
            except psutil.Error:
                pass
        return left

    def _inheritors(self) -> None:
        for p in psutil.process_iter():
            try:
                if p.pid != self.me.pid and p.environ().get(MARKER) == self.marker:
                    self.seen.setdefault((p.pid, p.create_time()), p)
            except psutil.Error:
                pass

    def _own_helper(self, p: psutil.Process) -> bool:
        """pytest's own multiprocessing resource tracker, which ends when pytest does."""
        return p.ppid() == self.me.pid and "multiprocessing.resource_tracker" in " ".join(p.cmdline())


_descendants: _Descendants | None = None


def pytest_sessionstart(session):
    global _descendants
    _descendants = _Descendants()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _descendants is None:
        return
    left = _descendants.still_running()
    if not left:
        return
    names = ", ".join(sorted(f"{_name(p)} (pid {p.pid})" for p in left))
    print(f"\nconftest: FAIL: {len(left)} process(es) the tests started outlived them: {names}; "
          "stopping them", file=sys.stderr)
    for p in left:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=20)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _name(p: psutil.Process) -> str:
    """Its name and command line (a renamed process shows its title there)."""
    try:
        return f"{p.name()} [{' '.join(p.cmdline())[:120]}]"
    except psutil.Error:
        return "?"


# The Serve test app (tests/serve_test_app.py): module-scoped, so each module that asks for
# ``app`` gets its own (the functional and the fault tests run on separate apps).
from serve_test_app import app, baseline, client, reference  # noqa: E402, F401
