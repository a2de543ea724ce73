"""The suite's session-end check (tests/conftest.py): a process a test started and left behind,
even one orphaned and renamed like vLLM's engine cores, fails the run and is stopped by pid."""
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

CLEAN = '''
import subprocess

def test_waits_for_what_it_starts():
    subprocess.run(["sleep", "0.1"], check=True)
'''


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_it.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    env.pop("PREFILLSHARE_TEST_SESSION", None)  # the inner session marks its own
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'base'}", str(tmp_path / "test_it.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_leftover_process_fails_the_session_and_is_stopped(tmp_path):
    out = _run(tmp_path, LEAKY)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 passed" in out.stdout
    assert "outlived them" in out.stderr and "VLLM::EngineCore" in out.stderr, out.stderr
    pid = int((tmp_path / "orphan.pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_clean_session_passes(tmp_path):
    out = _run(tmp_path, CLEAN)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outlived" not in out.stderr
