"""An engine core dies with the process that started it, even when that one is killed by SIGKILL.

A plain Python process builds an :class:`Engine` on a random-weight model with vLLM's spawn start
(as in a Ray Serve replica, where vLLM forces spawn), reports its engine-core pid and waits; the
test kills it with SIGKILL, which runs no shutdown code, and the orphaned core must go by itself,
leaving no named semaphore (``/dev/shm/sem.mp-*``) behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from random_models import make_models

pytestmark = [pytest.mark.engine]

ROOT = Path(__file__).resolve().parent.parent

PARENT = textwrap.dedent("""
    import os, sys, time
    import psutil
    from app.engine.async_engine import Engine, EngineConfig

    if __name__ == "__main__":
        engine = Engine(EngineConfig(model=sys.argv[1], dtype="float32", kv_cache_memory_bytes=64 << 20,
                                     max_model_len=128, block_size=32, max_num_seqs=2, enforce_eager=True,
                                     extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                "VLLM_CPU_OMP_THREADS_BIND": "nobind"}))
        cores = [p.pid for p in psutil.Process().children(recursive=True)]
        print("cores", *cores, flush=True)
        time.sleep(3600)
""")


def _semaphores() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("sem.mp-*")}


def test_engine_core_dies_when_its_parent_is_killed(tmp_path):
    paths = make_models(tmp_path, {})
    before = _semaphores()
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_WORKER_MULTIPROC_METHOD="spawn")
    parent = subprocess.Popen([sys.executable, str(script), str(paths["base"])], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    cores: list[psutil.Process] = []
    try:
        line = ""
        for line in parent.stdout:  # vLLM logs here too; blocks until the engine is up (or the parent died)
            if line.startswith("cores "):
                break
        assert line.startswith("cores "), f"the parent exited ({parent.wait()}) before its engine started"
        cores = [psutil.Process(int(pid)) for pid in line.split()[1:]]
        assert cores, "no engine-core process under the parent"
        assert any("EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline()) for c in cores)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        # waiting for the orphan's parent watch (it polls about once a second), not a timing assertion
        _, alive = psutil.wait_procs(cores, timeout=60)
        assert not alive, f"engine cores outlived their SIGKILLed parent: {[p.pid for p in alive]}"
        # tqdm's multiprocessing lock would be a named semaphore that only a clean exit unlinks
        assert _semaphores() - before == set(), "a killed engine left a named semaphore in /dev/shm"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
        for c in cores:
            try:
                c.kill()
            except psutil.Error:
                pass
