"""serve_config.yaml's engine, LoRA and pool settings -> what an engine and its connector take.

The one translation point: :func:`engine_config` turns a deployment's ``engine`` settings (and
its LoRA group) into an :class:`app.engine.async_engine.EngineConfig`, :func:`engine_env` gives
the env vars of its replica, :func:`pool_specs` turns ``pool`` into the connector's PoolSpecs.
docs/serving.md's settings table lists where each setting goes (tests/test_settings_table.py).
"""
from __future__ import annotations

from app.config import AppConfig, ConfigError, EngineSettings, LoRAGroup, Placement, PoolConfig

# vLLM on the CPU runs its worker in a third process unless this is off; inside EngineCore it
# measured less memory and CPU per session (docs/benchmarks.md, "Engine footprint"). Only with
# threads_bind 'nobind': vLLM pins OpenMP threads to a core list only from its multiprocess executor.
CPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine_env(cfg: AppConfig, p: Placement, eng: EngineSettings) -> dict[str, str]:
    """The one set of env vars an engine replica gets (its Ray runtime env and its engine core)."""
    base = dict(CPU_ENGINE_ENV) if not p.num_gpus and eng.threads_bind == "nobind" else {}
    return {**base, "VLLM_CPU_OMP_THREADS_BIND": eng.threads_bind, "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", **cfg.engine_env, **p.env}


def engine_config(cfg: AppConfig, model: str, eng: EngineSettings, placement: Placement,
                  kv_transfer_config: dict | None, lora: LoRAGroup | None = None):
    from app.engine.async_engine import EngineConfig

    adapters = tuple((a.name, str(cfg.path(a.path))) for a in lora.adapters) if lora is not None else ()
    return EngineConfig(
        model=str(cfg.path(model)), tokenizer=str(cfg.path(cfg.tokenizer)), dtype=eng.dtype,
        kv_space_gib=eng.kv_cache_gib, max_model_len=eng.max_model_len, block_size=eng.block_size,
        max_num_seqs=eng.max_num_seqs, omp_threads_bind=eng.threads_bind, enforce_eager=eng.enforce_eager,
        gpu_memory_utilization=eng.gpu_memory_utilization,
        kv_transfer_config=kv_transfer_config, seed=eng.seed, request_timeout_s=cfg.limits.request_timeout_s,
        extra_env=engine_env(cfg, placement, eng), lora_adapters=adapters,
        max_lora_rank=lora.max_lora_rank if lora is not None else 16,
        max_loras=lora.lora_slots if lora is not None else 1,
    )


def pool_specs(pool: PoolConfig):
    """(producer pool, consumer pool) as the connector takes them (app.engine.kv_pool.PoolSpec):
    producers write their node's shared-memory pool; with transport 'nixl' consumers fill their
    own node's pool from the block servers."""
    from app.engine.kv_pool import PoolSpec

    common = dict(capacity_bytes=int(pool.capacity_gib * (1 << 30)), lease_timeout_s=pool.fan_out_ttl_s,
                  check=pool.check)
    producer = PoolSpec(path=pool.path, transport="shm", **common)
    if pool.transport == "shm":
        return producer, producer
    if not pool.nixl_peers:
        raise ConfigError("pool.nixl_peers: transport 'nixl' needs the host:port of at least one KV block "
                          "server (deployments/kv_server.py) for the decoders to pull from")
    return producer, PoolSpec(path=pool.decode_path or pool.path, transport="nixl",
                              nixl_peers=tuple(pool.nixl_peers), nixl_timeout_s=pool.nixl_timeout_s, **common)
