"""PYTORCH_CUDA_ALLOC_CONF with expandable_segments:True beside a KV connector: refused before vLLM
is reached, typed, naming the variable (vLLM 0.26 and 0.32 refuse it from inside the engine core)."""
import asyncio

import pytest

from prefillshare.app.engine import alloc_conf
from prefillshare.app.engine.nixl.config import nixl_transfer_config

KV = nixl_transfer_config("producer", lease_s=30, kv_buffer_device="cuda")


def test_expandable_segments_beside_a_connector_is_a_typed_error():
    bad = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}
    with pytest.raises(alloc_conf.ExpandableSegmentsError, match="PYTORCH_CUDA_ALLOC_CONF.*expandable_segments"):
        alloc_conf.check(bad, KV, where="decoders lookup")
    alloc_conf.check(bad, None)  # no connector: vLLM accepts it
    alloc_conf.check(bad, KV, {"enable_cumem_allocator": True})  # vLLM's cumem pool keeps KV pages fixed
    alloc_conf.check({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, KV)
    alloc_conf.check({}, KV)


def test_an_engine_start_refuses_it_before_vllm_is_built():
    from prefillshare.app.engine.async_engine import Engine, EngineConfig

    cfg = EngineConfig(model="checkpoints/base", kv_transfer_config=KV,
                       extra_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    with pytest.raises(alloc_conf.ExpandableSegmentsError):
        asyncio.run(Engine.start(cfg))


def test_the_app_refuses_it_when_built(tmp_path):
    from pathlib import Path

    from prefillshare.app.config import load_config
    from prefillshare.deployments.application import build

    root = Path(__file__).resolve().parent.parent
    cfg = load_config(root / "serve_config.yaml")
    cfg = cfg.model_copy(update={"handover": "vllm-nixl",
                                 "engine_env": {**cfg.engine_env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}})
    with pytest.raises(alloc_conf.ExpandableSegmentsError, match="prefill_modules base"):
        build(cfg)
