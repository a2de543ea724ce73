"""An engine's OpenMP threads on CPUs come from its replica's ``placement.num_cpus`` (docs/serving.md):
under ``threads_bind: nobind`` vLLM leaves torch's thread count alone, and Ray sets OMP_NUM_THREADS
of an actor to its CPUs rounded down, at least 1, before the actor's code imports torch. A canary on
that Ray behaviour: the bench's i-lora engine and any user who gives an engine replica whole cores
rely on it. An OMP_NUM_THREADS in the environment that starts Ray wins (Ray then sets nothing), and
an in-process vLLM engine of an earlier test sets it in this process, so the test removes it.
Run through scripts/test.sh (loopback-only network namespace)."""
from __future__ import annotations

import os
import shutil

import pytest

pytestmark = pytest.mark.serve


def test_ray_gives_an_actor_its_whole_cpus_as_openmp_threads(monkeypatch):
    import ray

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    tmp = f"/tmp/romp{os.getpid()}"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
    try:
        @ray.remote
        class Threads:
            def read(self) -> tuple[str | None, int]:
                import torch

                return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()

        got = {n: ray.get(Threads.options(num_cpus=n).remote().read.remote(), timeout=180) for n in (0.25, 2)}
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    assert got == {0.25: ("1", 1), 2: ("2", 2)}, got
