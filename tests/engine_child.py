"""Run an offline vLLM engine in a spawned child process and take its one answer.

vLLM's offline ``LLM`` leaves process-wide state behind, so tests that need one run it in a child.
The parent polls: a child that dies before answering (an engine that failed to start) fails the
test at once instead of after the whole timeout.
"""
from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod
import time

import pytest

from prefillshare.app.engine_args import CPU_ENGINE_ENV

# A fixed KV space: vLLM's CPU worker otherwise reserves gpu_memory_utilization x the machine's
# memory and refuses to start when other processes hold more than the rest.
KV_CACHE_BYTES = 256 << 20
# The env of an engine a test builds itself, as the app runs its CPU engines
# (prefillshare.app.engine_args.CPU_ENGINE_ENV): vLLM's worker inside the engine core's process (and an offline
# LLM's engine core inside its own), not more processes that each import vLLM again.
CPU_TEST_ENGINE_ENV = {**CPU_ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _in_child_env(target, *args) -> None:
    os.environ.update(CPU_TEST_ENGINE_ENV)
    target(*args)


def run_in_child(target, *args, timeout_s: float = 600.0):
    """``target(*args, queue)`` in a spawned process; returns what it puts on the queue."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_in_child_env, args=(target, *args, q))
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return q.get(timeout=5)
            except queue_mod.Empty:
                if not proc.is_alive():
                    pytest.fail(f"the vLLM child exited with code {proc.exitcode} before answering (see its log)")
                if time.monotonic() > deadline:
                    pytest.fail(f"the vLLM child gave no answer in {timeout_s:.0f}s")
    finally:
        proc.join(60)  # if it still runs, the session finish (conftest.py) stops its whole tree
