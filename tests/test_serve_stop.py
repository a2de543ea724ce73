"""Stopping the app without its shutdown code gives back what it took: `serve run` loses a decoder
replica (its engine core runs the model in a ``VLLM::Worker`` process, as on GPUs) to SIGKILL and
then gets SIGTERM (serve run only exits: Ray kills the replicas, no replica
shutdown runs). No process of it is left and no /dev/shm file but its KV pool, which the next start
reclaims in place. Every process is tracked by ancestry (a descendant of `serve run`, sampled while
it runs) and by an environment marker it inherits, so vLLM's renamed ``VLLM::EngineCore`` processes
are seen whatever their command line says.

The clean stop (Ctrl-C of `make serve`: Serve's graceful shutdown), which removes the pool, is
checked on the default application by tests/test_serve_cli.py's teardown.

A small app of random models (one prefill replica, one decoder). Run through scripts/test.sh
(loopback-only network namespace).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
import yaml
from process_tracking import ProcessTracker, is_running, kill_all, title
from shm_tracking import residues

from bench.random_models import free_port, make_models, small_serve_config
from prefillshare.app.engine.niceness import niceness_of

pytestmark = [pytest.mark.serve, pytest.mark.engine]

ROOT = Path(__file__).resolve().parent.parent
SERVE = str(ROOT / ".venv" / "bin" / "serve")
MARKER = "PREFILLSHARE_STOP_TEST"


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=10) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("models"), {"alpha": (1, {})})


def _run_and_stop(tmp: Path, models: dict[str, Path], pool: str, kill_a_decoder: bool, stop: signal.Signals) -> dict:
    """One `serve run` from start to ``stop``; what was left of it after, and what it had."""
    tmp.mkdir()
    port = free_port()
    cfg = tmp / "serve.yaml"
    cfg.write_text(yaml.safe_dump(small_serve_config(models, pool, port)))
    marker = uuid.uuid4().hex
    ray_tmp = f"/tmp/rst{os.getpid()}{tmp.name[0]}"  # short: Ray's socket paths have a length limit
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, **{MARKER: marker})
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 - closed below
    # SIGINT as a terminal delivers it, even when this suite runs as a background job (which ignores
    # SIGINT and passes that on: `serve run` would never see its Ctrl-C)
    proc = subprocess.Popen([SERVE, "run", str(cfg)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    tracked = ProcessTracker(psutil.Process(proc.pid), (MARKER, marker))
    out = {"killed_cores_left": []}
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):  # waiting for startup, not a timing assertion
            if proc.poll() is not None:
                pytest.fail(f"serve run exited ({proc.returncode}) before the app was ready; see {log.name}")
            if _ready(url):
                break
            time.sleep(2)
        else:
            pytest.fail(f"the app was not ready in 10 minutes; see {log.name}")
        tracked.sample()
        out["cores"] = sum("EngineCore" in title(p) for p in tracked.running())
        if kill_a_decoder:  # a replica dies by SIGKILL: its engine core must not outlive it
            (replica,) = [p for p in tracked.running() if "Decode-alpha" in title(p) and "EngineCore" not in title(p)]
            cores = [c for c in replica.children(recursive=True) if "EngineCore" in title(c) or "Worker" in title(c)]
            assert {t for c in cores for t in ("EngineCore", "Worker") if t in title(c)} == {"EngineCore", "Worker"}, \
                [title(c) for c in replica.children(recursive=True)]
            out["niceness"] = {"decoder_replica": set(niceness_of(replica.pid)),
                               "decoder_cores": {n for c in cores for n in niceness_of(c.pid)},
                               "prefill_core": {n for p in tracked.running() if "EngineCore" in title(p)
                                                and p.pid not in {c.pid for c in cores} for n in niceness_of(p.pid)}}
            replica.kill()
            _, alive = psutil.wait_procs(cores, timeout=60)
            out["killed_cores_left"] = [c for c in alive if is_running(c)]  # waiting for the parent watch
        os.kill(proc.pid, stop)
        proc.wait(timeout=180)
        # waiting for the processes to finish exiting, not a timing assertion
        tracked.sample()
        psutil.wait_procs(tracked.running(), timeout=60)
    finally:
        left = tracked.stop()
        out["left"] = [f"{p.pid} {title(p)}" for p in left]
        kill_all(left)  # never leave them running, even when the assertions below fail
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return out


def test_serve_run_stopped_without_shutdown_leaves_no_process_and_only_a_reclaimable_pool(tmp_path, models):
    from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec

    pool = f"/dev/shm/ps-stop-{os.getpid()}"
    shm_before = _shm()
    try:
        run = _run_and_stop(tmp_path / "run", models, pool, kill_a_decoder=True, stop=signal.SIGTERM)
        assert run["cores"] >= 2, run  # the tracking saw the prefill's and the decoder's engine cores
        assert run["left"] == [], run
        assert run["killed_cores_left"] == [], "a SIGKILLed replica's engine core or its worker outlived it"
        # engine.serving_niceness: every thread of the decoder's core and worker, not its replica, nor
        # the prefill engine, which does not set it (those keep what Ray spawned them with: its
        # worker_niceness, 15 by default, on most threads)
        nice = run["niceness"]
        assert nice["decoder_cores"] == {19} and 19 not in nice["decoder_replica"] | nice["prefill_core"], nice
        # nothing but the pool: no multiprocessing semaphore (sem.mp-*: a SIGKILLed engine core's
        # tqdm lock left one, see app/engine/core_lifetime.py) and no shared-memory segment (psm_*).
        # /dev/shm is the machine's: only such entries that appeared meanwhile and that no live
        # process maps are the stopped app's (every process of it is gone: run["left"] above)
        new_shm = sorted(_shm() - shm_before - {Path(pool).name})
        assert residues(new_shm) == [], new_shm
        # no replica ran its shutdown, so the pool is still there; the next start (its first
        # engine opening the pool) finds no live owner and makes it afresh in the same folder
        assert Path(pool, "slab-index.sqlite").exists()
        reopened = KVPool(PoolSpec(pool, capacity_bytes=1 << 20))
        assert reopened.capacity_bytes == 1 << 20  # made afresh: the dead app's 64 MiB slab is gone
        reopened.close()
        assert not Path(pool).exists()  # its last owner closed it
    finally:
        shutil.rmtree(pool, ignore_errors=True)
