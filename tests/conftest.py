"""Suite-wide hygiene: nothing a test started outlives the session.

A vLLM engine core or a Ray daemon left behind by a failed or interrupted test is a
non-daemon child of pytest; at exit Python would wait for it forever and CI would hang
after the summary. Stop whatever is left, and say what it was.
"""
from __future__ import annotations

import sys

import psutil
import pytest


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    left = psutil.Process().children(recursive=True)
    if not left:
        return
    names = sorted({_name(p) for p in left})
    print(f"\nconftest: stopping {len(left)} process(es) the tests left running: {', '.join(names)}",
          file=sys.stderr)
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


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"
