"""Suite-wide hygiene: nothing a test started outlives the session, a leftover fails the run, and
so does a skip in CI.

- Processes: what the tests start is tracked by ancestry and by an environment marker every child
  inherits (tests/process_tracking.py), never by command line (vLLM renames its engine cores
  ``VLLM::EngineCore``; an orphan has lost its parent). At session end whatever of it still runs
  is named, stopped by pid (SIGTERM, then SIGKILL), and the session fails.
- /dev/shm: an entry that appeared during the session and is still there at its end (a KV pool
  not given back) is named with the test it appeared during, removed, and the session fails
  (tests/shm_tracking.py; with another test session running beside this one, outside CI, it is
  only reported). A residue of a process killed mid-way (a multiprocessing semaphore or
  shared-memory segment that no process maps) is removed and reported without failing.
- Skips: under ``CI=true`` a skipped test fails the run; the suite has nothing that may be absent.
- Hangs: a test past its timeout fails with the frames it was in on its summary line
  (tests/hang_report.py), the part of a CI log that is kept.
- Randomness: each test starts with ``random`` (and torch, numpy when loaded) seeded from the
  session's seed and its node id; the seed is printed in the header and with each failure, and
  ``PREFILLSHARE_TEST_SEED=<seed>`` repeats it.
"""
from __future__ import annotations

import os
import random
import sys
import time
import uuid
import zlib

import hang_report
import psutil
import pytest
import shm_tracking
from process_tracking import ProcessTracker, kill_all, title

MARKER = "PREFILLSHARE_TEST_SESSION"
SEED_ENV = "PREFILLSHARE_TEST_SEED"
_tracker: ProcessTracker | None = None
_started = time.monotonic()
_last_file: str | None = None
_shm_before: set[str] = set()
_others_at_start = False
_skipped: list[str] = []
_module_s: dict[str, float] = {}  # test file -> seconds its tests took, their fixtures' set-up and teardown included
_test_started: dict[str, float] = {}
# (start, node id) of each test in order, on the clock the kernel stamps files with (a coarse one)
_timeline: list[tuple[float, str]] = []
_FILE_CLOCK = 5  # Linux's CLOCK_REALTIME_COARSE, which Python's time module does not name
_seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(1 << 31))


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def pytest_sessionstart(session):
    global _tracker, _shm_before, _others_at_start
    marker = os.environ.setdefault(MARKER, uuid.uuid4().hex)
    _tracker = ProcessTracker(psutil.Process(), (MARKER, marker))
    _shm_before = shm_tracking.snapshot()
    _others_at_start = bool(shm_tracking.other_sessions((MARKER, marker)))


def _seed_line() -> str:
    return f"random seed: {_seed} (repeat it with {SEED_ENV}={_seed})"


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter):
    """The time of each test file (the table docs/testing.md keeps from a full run), then the seed."""
    if len(_module_s) > 1:
        terminalreporter.write_sep("=", "time per test file")
        terminalreporter.write_line("| file | tests' time (s) |")
        terminalreporter.write_line("|---|---:|")
        for path, seconds in sorted(_module_s.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"| `{path}` | {seconds:.0f} |")
    terminalreporter.write_line(_seed_line())  # also with -q, which drops the header


def pytest_runtest_setup(item):
    """Seed the test's randomness from the session's seed and its node id (the same whatever runs before it)."""
    seed = zlib.crc32(f"{_seed}:{item.nodeid}".encode())
    random.seed(seed)
    for name in ("torch", "numpy"):
        module = sys.modules.get(name)
        if module is not None:
            (module.manual_seed if name == "torch" else module.random.seed)(seed)
    item.add_report_section("setup", "random seed", f"session seed {_seed}, this test's {seed}: rerun with "
                                                    f"{SEED_ENV}={_seed}")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


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
    _test_started[nodeid] = time.monotonic()
    _timeline.append((time.clock_gettime(_FILE_CLOCK), nodeid))


def pytest_runtest_logfinish(nodeid, location):
    path = nodeid.split("::", 1)[0]
    _module_s[path] = _module_s.get(path, 0.0) + time.monotonic() - _test_started.pop(nodeid, time.monotonic())


def _write(text: str) -> None:
    reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    if reporter is not None:
        reporter.write(text)


_config: pytest.Config | None = None


def pytest_configure(config):
    global _config
    _config = config
    config.pluginmanager.register(hang_report, "hang_report")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _last_file is not None:
        _write(f" {time.monotonic() - _started:.0f}s")
    if _tracker is None:
        return
    left = [p for p in _tracker.stop() if not _pytest_helper(p)]
    if left:
        print(f"\nconftest: FAIL: {len(left)} process(es) the tests started outlived them: "
              f"{', '.join(sorted(f'{title(p)} (pid {p.pid})' for p in left))}; stopping them", file=sys.stderr)
        kill_all(left, grace_s=20)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _check_shm(session)
    if _skipped and _in_ci():
        print(f"\nconftest: FAIL: {len(_skipped)} test(s) skipped under CI=true (nothing in this suite may be "
              f"absent in CI): {', '.join(_skipped[:20])}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _check_shm(session) -> None:
    """Fail on what the session left in /dev/shm (after its processes are gone), and remove it;
    residues of processes killed mid-way are removed and reported only (tests/shm_tracking.py)."""
    new = shm_tracking.leftovers(_shm_before)
    if not new:
        return
    named = {n: f"{shm_tracking.SHM / n} ({_appeared_during(n)})" for n in new}
    if not _in_ci() and (_others_at_start or shm_tracking.other_sessions((MARKER, os.environ[MARKER]))):
        print(f"\nconftest: /dev/shm gained {len(new)} entr(ies) while another test session ran beside this "
              f"one, so they may be its: {', '.join(named.values())}; left in place", file=sys.stderr)
        return
    killed = shm_tracking.residues(new)
    if killed:
        shm_tracking.remove(killed)
        print(f"\nconftest: removed {len(killed)} residue(s) of processes killed mid-way (a multiprocessing "
              f"semaphore or shared-memory segment no process maps): {', '.join(named[n] for n in killed)}",
              file=sys.stderr)
        new = [n for n in new if n not in killed]
        if not new:
            return
    print(f"\nconftest: FAIL: the tests left {len(new)} entr(ies) in /dev/shm: "
          f"{', '.join(named[n] for n in new[:20])}; removing them", file=sys.stderr)
    shm_tracking.remove(new)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _appeared_during(name: str) -> str:
    """The test that was running when ``name`` appeared in /dev/shm (so a leftover names its test)."""
    at = shm_tracking.made_at(name)
    if at is None:
        return "gone"
    during = [nodeid for started, nodeid in _timeline if started <= at]
    return f"appeared during {during[-1]}" if during else "appeared before the first test"


def _pytest_helper(p: psutil.Process) -> bool:
    """pytest's own multiprocessing resource tracker, which ends when pytest does."""
    try:
        return p.ppid() == os.getpid() and "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False
