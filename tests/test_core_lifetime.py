"""The engine-core and worker hooks of app/engine/core_lifetime.py replace vLLM's spawn targets
once, keep vLLM's own entries to call, and stay so when installed again (every Engine installs
them). What the hooks do in a killed app: tests/test_serve_stop.py."""
from __future__ import annotations

from app.engine import core_lifetime


def test_the_hooks_take_vllms_spawn_targets_once_and_keep_vllms_entries(monkeypatch):
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    # put everything back afterwards: this process's later engines start as they would have
    for cls, name in ((EngineCoreProc, "run_engine_core"), (WorkerProc, "worker_main")):
        monkeypatch.setattr(cls, name, cls.__dict__[name])
    for name in ("_vllm_run_engine_core", "_vllm_worker_main"):
        monkeypatch.setattr(core_lifetime, name, getattr(core_lifetime, name))
    vllm_worker_main = WorkerProc.__dict__["worker_main"].__func__
    for _ in range(2):
        core_lifetime.install()
        core_lifetime._hook_workers()
    assert EngineCoreProc.__dict__["run_engine_core"].__func__ is core_lifetime.run_engine_core
    assert WorkerProc.__dict__["worker_main"].__func__ is core_lifetime.run_worker
    # the saved entries are vLLM's, never the hooks themselves (a hook calling itself would recurse)
    assert core_lifetime._vllm_worker_main is vllm_worker_main
    assert core_lifetime._vllm_run_engine_core not in (None, core_lifetime.run_engine_core)
    assert core_lifetime._vllm_run_engine_core.__module__ == "vllm.v1.engine.core"
