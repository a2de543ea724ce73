"""An engine's OpenMP threads on CPUs come from its replica's ``placement.num_cpus`` (docs/serving.md):
under ``threads_bind: nobind`` vLLM leaves torch's thread count alone, and Ray sets OMP_NUM_THREADS
of an actor to its CPUs rounded down, at least 1, before the actor's code imports torch. A canary on
that Ray behaviour: the bench's i-lora engine and any user who gives an engine replica whole cores
rely on it. The cluster starts in a fresh process with a shell's plain environment, as `serve run`
does: thread settings an earlier test left in this process (an in-process vLLM engine sets
OMP_NUM_THREADS, and one set there wins over Ray's) must not decide it.
Run through scripts/test.sh (loopback-only network namespace)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.serve

PROBE = """
import json, os, shutil, sys
import ray
tmp = sys.argv[1]
ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
try:
    @ray.remote
    class Threads:
        def read(self):
            import torch
            return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    got = {str(n): ray.get(Threads.options(num_cpus=n).remote().read.remote(), timeout=180) for n in (0.25, 2)}
finally:
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
print(json.dumps(got))
"""
# what a login shell carries; nothing that sets threads
PLAIN_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "RAY_AUTH_MODE", "VIRTUAL_ENV")


def test_ray_gives_an_actor_its_whole_cpus_as_openmp_threads():
    env = {k: v for k, v in os.environ.items() if k in PLAIN_ENV}
    # its own process group: a probe past its time goes with the Ray daemons it started
    proc = subprocess.Popen([sys.executable, "-c", PROBE, f"/tmp/romp{os.getpid()}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got == {"0.25": ["1", 1], "2": ["2", 2]}, got
