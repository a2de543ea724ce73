"""Suite-wide hygiene: nothing a test started outlives the session, and a leftover fails the run.

What the tests start is tracked by ancestry and by an environment marker every child inherits
(tests/process_tracking.py), never by command line (vLLM renames its engine cores
``VLLM::EngineCore``; an orphan has lost its parent). At session end whatever of it still runs is
named, stopped by pid (SIGTERM, then SIGKILL), and the session fails.
"""
from __future__ import annotations

import os
import sys
import time
import uuid

import psutil
import pytest
from process_tracking import ProcessTracker, kill_all, title

MARKER = "PREFILLSHARE_TEST_SESSION"
_tracker: ProcessTracker | None = None
_started = time.monotonic()
_last_file: str | None = None


def pytest_sessionstart(session):
    global _tracker
    marker = os.environ.setdefault(MARKER, uuid.uuid4().hex)
    _tracker = ProcessTracker(psutil.Process(), (MARKER, marker))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    """Ends each test file's progress line with the seconds since the session began.

    A run stopped by a CI time limit prints no durations table; these stamps still show where
    its time went.
    """
    global _last_file
    path = nodeid.split("::", 1)[0]
    if _last_file is not None and path != _last_file:
        _write(f" {time.monotonic() - _started:.0f}s")
    _last_file = path


def _write(text: str) -> None:
    reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    if reporter is not None:
        reporter.write(text)


_config: pytest.Config | None = None


def pytest_configure(config):
    global _config
    _config = config


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _last_file is not None:
        _write(f" {time.monotonic() - _started:.0f}s")
    if _tracker is None:
        return
    left = [p for p in _tracker.stop() if not _pytest_helper(p)]
    if not left:
        return
    print(f"\nconftest: FAIL: {len(left)} process(es) the tests started outlived them: "
          f"{', '.join(sorted(f'{title(p)} (pid {p.pid})' for p in left))}; stopping them", file=sys.stderr)
    kill_all(left, grace_s=20)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _pytest_helper(p: psutil.Process) -> bool:
    """pytest's own multiprocessing resource tracker, which ends when pytest does."""
    try:
        return p.ppid() == os.getpid() and "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False
