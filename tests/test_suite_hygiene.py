"""The suite's session-end rules (tests/conftest.py): a process a test started and left behind, even
one orphaned and renamed like vLLM's engine cores, fails the run and is stopped by pid; under
CI=true a skip fails it, and so does an entry left in /dev/shm (removed); the printed seed repeats
a session's random draws; a hung test's summary line says where it was."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent

LEAKY = '''
import subprocess, sys

def test_leaves_an_orphan(tmp_path):
    # a grandchild whose parent exits at once: an orphan, no longer below pytest, with a renamed
    # command line (exec -a), as vLLM's setproctitle does to its engine cores
    out = subprocess.run(["bash", "-c", "exec -a VLLM::EngineCore sleep 300 >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    (tmp_path.parent.parent / "orphan.pid").write_text(out.stdout.strip())
'''

# a skip, a pool left behind in /dev/shm and a random draw: what the session-end rules judge
POLICY = '''
import os
import random
import time

import pytest

def test_draws():
    print("drew", random.random())

def test_leaves_a_pool_behind():
    if os.environ.get("HYGIENE_SHM_DIR"):
        os.makedirs(os.environ["HYGIENE_SHM_DIR"])
    time.sleep(0.05)  # the next test starts a tick of the file clock later

def test_skips():
    pytest.skip("something is absent")
'''


def _run(tmp_path: Path, body: str, **env_over: str) -> subprocess.CompletedProcess:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_it.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]), **env_over)
    env.pop("PREFILLSHARE_TEST_SESSION", None)  # the inner session marks its own
    if "CI" not in env_over:
        env.pop("CI", None)
    if "PREFILLSHARE_SHM_WATCHED" not in env_over:  # /dev/shm is shared with whatever else runs here
        (tmp_path / "shm-watched").mkdir(exist_ok=True)
        env["PREFILLSHARE_SHM_WATCHED"] = str(tmp_path / "shm-watched")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'base'}", str(tmp_path / "test_it.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_leftover_process_fails_the_session_and_is_stopped(tmp_path):
    out = _run(tmp_path, LEAKY)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 passed" in out.stdout
    assert "outlived them" in out.stderr and "VLLM::EngineCore" in out.stderr, out.stderr
    pid = int((tmp_path / "orphan.pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# a test past its timeout inside a helper, and a bounded call that never returns
HUNG = '''
import time

import pytest
from hang_report import bounded

def wait_for_ever():
    time.sleep(600)

@pytest.mark.timeout(2)
def test_hangs():
    wait_for_ever()

def test_bounded_call_is_stuck():
    bounded(wait_for_ever, 1, "the wait")
'''


def test_a_hung_test_and_a_stuck_call_name_their_frames_on_the_summary_line(tmp_path):
    """CI keeps the tail of the log: the short summary must say where each one was."""
    out = _run(tmp_path, HUNG, CI="true")
    assert out.returncode == 1 and "2 failed" in out.stdout, out.stdout + out.stderr
    summary = out.stdout[out.stdout.index("short test summary"):]
    assert "Timeout (>2s); the test was at test_it.py:8 wait_for_ever < test_it.py:12 test_hangs" in summary, summary
    assert "Stuck: the wait: no answer in 1 s; stuck at test_it.py:8 wait_for_ever" in summary, summary


def _draws(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stdout.splitlines() if "drew" in line]


def test_under_ci_a_skip_and_a_leftover_in_dev_shm_fail_the_run_and_the_seed_repeats_the_draws(tmp_path):
    """One inner session with CI=true, one without (a clean session: it passes). The /dev/shm check watches a folder of this
    test's own (the real one is shared with whatever else runs on the machine)."""
    shm = tmp_path / "shm"
    (shm / "there-before").mkdir(parents=True)
    left = shm / "ps-test-pool-left"
    ci = _run(tmp_path, POLICY, CI="true", PREFILLSHARE_TEST_SEED="12345", HYGIENE_SHM_DIR=str(left),
              PREFILLSHARE_SHM_WATCHED=str(shm))
    assert ci.returncode == 1 and "2 passed, 1 skipped" in ci.stdout, ci.stdout + ci.stderr
    assert "skipped under CI=true" in ci.stderr and "test_skips" in ci.stderr, ci.stderr
    assert f"left 1 entr(ies) in /dev/shm: {left} (appeared during test_it.py::test_leaves_a_pool_behind)" \
        in ci.stderr, ci.stderr
    assert not left.exists() and (shm / "there-before").is_dir()  # removed; what was there before stays
    assert "random seed: 12345" in ci.stdout
    local = _run(tmp_path, POLICY, PREFILLSHARE_TEST_SEED="12345", PREFILLSHARE_SHM_WATCHED=str(shm))
    assert local.returncode == 0, local.stdout + local.stderr  # a clean session, and outside CI a skip is fine
    assert "/dev/shm" not in local.stderr and "outlived" not in local.stderr, local.stderr
    assert _draws(ci) and _draws(ci) == _draws(local)  # the same seed, the same draws


RESIDUE = '''
import os

def test_leaves_what_a_killed_process_would():
    open(os.environ["HYGIENE_RESIDUE"], "wb").close()
'''


def test_a_killed_processs_residue_is_removed_and_reported_without_failing_the_run(tmp_path):
    """Under CI=true (which judges alone, whatever else runs): a multiprocessing semaphore that no
    process maps is removed and reported with its test, and the session passes."""
    shm = tmp_path / "shm"
    shm.mkdir()
    residue = shm / "sem.mp-hygiene"
    out = _run(tmp_path, RESIDUE, CI="true", PREFILLSHARE_SHM_WATCHED=str(shm), HYGIENE_RESIDUE=str(residue))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"removed 1 residue(s) of processes killed mid-way (a multiprocessing semaphore or shared-memory " \
           f"segment no process maps): {residue} (appeared during test_it.py::test_leaves_what_a_killed_process_would)" \
        in out.stderr, out.stderr
    assert not residue.exists() and "FAIL" not in out.stderr, out.stderr


def test_a_residue_is_one_that_no_live_process_maps(tmp_path):
    """shm_tracking.residues: a semaphore-like file this process maps is in use, not a residue;
    once unmapped it is; a KV pool's folder never is."""
    import mmap

    import shm_tracking

    seg = tmp_path / "psm_probe"
    seg.write_bytes(b"\0" * 4096)
    (tmp_path / "prefillshare-pool").mkdir()
    names = ["psm_probe", "prefillshare-pool"]
    with open(seg, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:
        m[:1] = b"x"
        assert shm_tracking.residues(names, root=tmp_path) == []
    assert shm_tracking.residues(names, root=tmp_path) == ["psm_probe"]
