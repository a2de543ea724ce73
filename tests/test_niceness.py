"""app/engine/niceness.py on real processes: every thread of a process and of its descendants gets
the serving niceness (Linux niceness is per thread), a thread already nicer keeps its own, and
the caller is left as it was. The engine-level check (a served decoder's core and worker reniced,
its replica and the other engine not) is in tests/test_serve_stop.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from prefillshare.app.engine.niceness import niceness_of, renice_tree

# a process with a second thread, and a child that has a second thread too
_CHILD = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
if sys.argv[1] == "parent":
    subprocess.Popen([sys.executable, "-c", sys.argv[2], "leaf", sys.argv[2]])
print("up", flush=True)
time.sleep(120)
"""


def _tree():
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, "parent", _CHILD], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    parent = psutil.Process(proc.pid)
    for _ in range(200):  # waiting for the leaf and both threads to exist, not a timing assertion
        kids = parent.children(recursive=True)
        if kids and all(len(os.listdir(f"/proc/{p}/task")) >= 2 for p in [proc.pid, *(k.pid for k in kids)]):
            return proc, [proc.pid, *(k.pid for k in kids)]
        time.sleep(0.05)
    raise AssertionError("the test tree did not come up")


def _stop(proc, pids):
    for pid in reversed(pids):
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs([p for p in map(_proc, pids) if p is not None], timeout=10)


def _proc(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_every_thread_of_the_tree_gets_the_niceness_and_the_caller_keeps_its_own():
    mine = niceness_of(os.getpid())
    proc, pids = _tree()
    try:
        assert all(n == 0 for pid in pids for n in niceness_of(pid))
        changed = renice_tree(proc.pid, 7)
        assert changed == sum(len(niceness_of(pid)) for pid in pids) >= 4
        assert {pid: set(niceness_of(pid)) for pid in pids} == {pid: {7} for pid in pids}
        assert niceness_of(os.getpid()) == mine
    finally:
        _stop(proc, pids)


def test_a_thread_already_nicer_is_left_as_it_is():
    proc, pids = _tree()
    try:
        leaf = pids[-1]
        tid = int(sorted(os.listdir(f"/proc/{leaf}/task"))[0])
        os.setpriority(os.PRIO_PROCESS, tid, 15)
        renice_tree(proc.pid, 7)
        assert os.getpriority(os.PRIO_PROCESS, tid) == 15
        assert set(niceness_of(proc.pid)) == {7}
    finally:
        _stop(proc, pids)


def test_a_process_gone_meanwhile_changes_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert renice_tree(proc.pid, 7) == 0
