"""Where a hung test was, in its failure line.

CI keeps only the tail of the run's output: the short summary, not the stacks pytest-timeout
dumps higher up. So a test that outlives its timeout (``[tool.pytest.ini_options] timeout``)
fails with a message that names the frames it was in, innermost first, and a call bounded with
``bounded`` names where its worker thread was stuck.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback

import pytest

_SKIP = ("/threading.py", "/concurrent/futures/", "/pytest_timeout.py", "/_pytest/", "/pluggy/", "/pytest/__main__.py",
         "<frozen runpy>")


def where(frame, depth: int = 8) -> str:
    """``frame`` and its callers as ``file:line function``, innermost first, library noise dropped."""
    out = []
    for entry in reversed(traceback.extract_stack(frame)):
        if any(s in entry.filename for s in _SKIP) or entry.filename == __file__:
            continue
        out.append(f"{_short(entry.filename)}:{entry.lineno} {entry.name}")
        if len(out) == depth:
            break
    return " < ".join(out) or "(no Python frame)"


def _short(path: str) -> str:
    """A library file from its package down, a test file from tests/, anything else its name."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    if "/tests/" in path:
        return "tests/" + path.rsplit("/tests/", 1)[1]
    return os.path.basename(path)


class Stuck(AssertionError):
    """A ``bounded`` call that did not return in time; the message says where it was."""


def bounded(fn, timeout_s: float, what: str):
    """``fn()`` run in a daemon thread and waited for ``timeout_s``: a call that blocks anywhere
    (a Ray lookup, a router's start, a socket) raises Stuck with where it was instead of holding
    the test until pytest-timeout. The thread is left behind; it ends with the process."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e

    worker = threading.Thread(target=run, name=what, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        frame = sys._current_frames().get(worker.ident)
        raise Stuck(f"{what}: no answer in {timeout_s:.0f} s; stuck at {where(frame) if frame else '?'}")
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's signal method, with the main thread's frames in the failure message."""
    if settings.method != "signal" or not settings.timeout or threading.current_thread() is not threading.main_thread():
        return None

    def on_alarm(signum, frame):
        __tracebackhide__ = True
        pytest.fail(f"Timeout (>{settings.timeout:.0f}s); the test was at {where(frame)}", pytrace=True)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    item.stash[_ARMED] = True
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
    if not item.stash.get(_ARMED, False):
        return None
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    del item.stash[_ARMED]
    return True


_ARMED = pytest.StashKey[bool]()
