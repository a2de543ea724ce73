"""Builds the Ray Serve application from an AppConfig (serve_config.yaml's import_path).

Resolution happens here, once, before any engine starts: each decoder is matched to the
prefill module its manifest names and checked for compatibility; a decoder that cannot
share gets private prefill with a readable reason. Then one PrefillServer deployment per
prefill module (prefix-locality router), one DecodeServer deployment per decoder (own
placement-group bundles), the Orchestrator, the Metrics holder and the Router ingress.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.config import AppConfig, ConfigError, DecoderConfig, EngineSettings, Placement, load_config
from app.engine import compute_dtype
from deployments.messages import AppPlan, DecoderPlan, ModulePlan

log = logging.getLogger("ray.serve")

def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes of K and V over all layers for one token (what a decoder loads per shared token)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * int(cfg["num_hidden_layers"]) * int(heads) * int(head_dim) * compute_dtype.BYTES[compute_dtype.resolve(dtype)]


def resolve_decoder(cfg: AppConfig, d: DecoderConfig, module_ids: dict[str, str]) -> DecoderPlan:
    """Which prefill module feeds ``d``, or (code, readable reason) for private prefill."""
    from app.models import compat
    from app.models.identity import CheckpointError
    from app.models.manifest import ManifestError, read_manifest

    path = cfg.path(d.model)
    bpt = kv_bytes_per_token(path, d.engine.dtype)

    def private(code: str, detail: str) -> DecoderPlan:
        log.warning("decoder %s: private prefill (%s)", d.name, detail)
        return DecoderPlan(d.name, None, code, detail, bpt, d.engine.max_model_len)

    if d.prefill_module is None:
        return private("disabled", "prefill_module is null in the config")
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        return private("no_manifest", str(e))
    if d.prefill_module == "auto":
        name = next((n for n, i in module_ids.items() if i == manifest.prefill_module_id), None)
        if name is None:
            return private("no_prefill_module",
                           f"manifest names prefill module {manifest.prefill_module_id}; configured: {module_ids}")
    else:
        name = d.prefill_module
    base = cfg.prefill_module(name)
    try:
        verdict = compat.check(cfg.path(base.model), path, base_id=module_ids[name])
    except (ManifestError, CheckpointError) as e:
        return private("incompatible", str(e))
    reasons = list(verdict.reasons)
    if base.engine.block_size != d.engine.block_size:
        reasons.append(f"block_size differs: prefill module {base.engine.block_size}, decoder {d.engine.block_size}")
    if base.engine.dtype != d.engine.dtype:
        reasons.append(f"engine dtype differs: prefill module {base.engine.dtype}, decoder {d.engine.dtype}")
    if reasons:
        return private("incompatible", "; ".join(reasons))
    return DecoderPlan(d.name, name, None, None, bpt, d.engine.max_model_len)


def plan_app(cfg: AppConfig) -> tuple[AppPlan, dict[str, str]]:
    """The resolved plan and each prefill module's id."""
    from app.models.identity import prefill_module_id

    cfg.check_paths()
    module_ids = {p.name: prefill_module_id(cfg.path(p.model)) for p in cfg.prefill_modules}
    modules = tuple(ModulePlan(p.name, module_ids[p.name], p.engine.block_size) for p in cfg.prefill_modules)
    decoders = tuple(resolve_decoder(cfg, d, module_ids) for d in cfg.decoders)
    lim = cfg.limits
    plan = AppPlan(str(cfg.path(cfg.tokenizer)), modules, decoders, lim.max_tokens_default, lim.max_tokens_cap,
                   lim.max_agents, lim.max_rounds, lim.request_timeout_s, lim.prefill_wait_s)
    return plan, module_ids


def engine_config(cfg: AppConfig, model: str, eng: EngineSettings, placement: Placement,
                  kv_transfer_config: dict | None):
    from app.engine.async_engine import EngineConfig

    return EngineConfig(
        model=str(cfg.path(model)), tokenizer=str(cfg.path(cfg.tokenizer)), dtype=eng.dtype,
        kv_space_gib=eng.kv_cache_gib, max_model_len=eng.max_model_len, block_size=eng.block_size,
        max_num_seqs=eng.max_num_seqs, omp_threads_bind=eng.threads_bind, enforce_eager=eng.enforce_eager,
        gpu_memory_utilization=eng.gpu_memory_utilization,
        kv_transfer_config=kv_transfer_config, seed=eng.seed, request_timeout_s=cfg.limits.request_timeout_s,
        extra_env={**cfg.engine_env, **placement.env},
    )


def _actor_options(p: Placement, env: dict[str, str]) -> dict[str, Any]:
    opts: dict[str, Any] = {"num_cpus": p.num_cpus}
    if p.num_gpus:
        opts["num_gpus"] = p.num_gpus
    if env:
        opts["runtime_env"] = {"env_vars": dict(env)}
    return opts


def _engine_env(cfg: AppConfig, p: Placement, eng: EngineSettings) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": eng.threads_bind, "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", **cfg.engine_env, **p.env}


def pool_specs(cfg: AppConfig):
    """(producer pool, consumer pool): producers always write their node's shared-memory pool;
    with transport 'nixl' consumers fill their own node's pool from the block servers."""
    from app.engine.async_engine import PoolSpec

    common = dict(capacity_bytes=int(cfg.pool.capacity_gib * (1 << 30)), lease_timeout_s=cfg.pool.fan_out_ttl_s)
    producer = PoolSpec(path=cfg.pool.path, transport="shm", **common)
    if cfg.pool.transport == "shm":
        return producer, producer
    if not cfg.pool.nixl_peers:
        raise ConfigError("pool.nixl_peers: transport 'nixl' needs the host:port of at least one KV block "
                          "server (deployments/kv_server.py) for the decoders to pull from")
    return producer, PoolSpec(path=cfg.pool.decode_path or cfg.pool.path, transport="nixl",
                              nixl_peers=tuple(cfg.pool.nixl_peers), nixl_timeout_s=cfg.pool.nixl_timeout_s,
                              **common)


def build(cfg: AppConfig):
    """The Serve application (the Router ingress with everything bound beneath it)."""
    from ray.serve.config import BackpressureConfig, RequestRouterConfig

    from app.engine.async_engine import connector_config
    from deployments.decode import DecodeServer, PrefillNodeEngine
    from deployments.metrics import MetricsServer
    from deployments.node_router import NodeAffinityRouter
    from deployments.orchestrator import Orchestrator
    from deployments.prefill import PrefillServer
    from deployments.prefix_router import PrefixLocalityRouter
    from deployments.router import Router

    plan, module_ids = plan_app(cfg)
    # Serve's own shedding (max_queued_requests) answers 429 + Retry-After like the Router does.
    shed = dict(backpressure_config=BackpressureConfig(status_code=429, retry_after_s=cfg.limits.retry_after_s))
    pool, consumer_pool = pool_specs(cfg)

    metrics = MetricsServer.options(
        num_replicas=1, ray_actor_options={"num_cpus": cfg.metrics.num_cpus},
        max_ongoing_requests=cfg.metrics.max_ongoing_requests,
    ).bind(cfg.pool.path if cfg.pool.transport == "shm" else None)

    prefill = {}
    for p in cfg.prefill_modules:
        pl = p.placement
        kv = connector_config("producer", module_ids[p.name], pool, scope=p.name)
        opts: dict[str, Any] = dict(
            name=f"Prefill-{p.name}", num_replicas=pl.num_replicas, max_ongoing_requests=pl.max_ongoing_requests,
            max_queued_requests=pl.max_queued_requests, **shed,
            ray_actor_options=_actor_options(pl, _engine_env(cfg, pl, p.engine)),
            request_router_config=RequestRouterConfig(
                request_router_class=PrefixLocalityRouter,
                request_router_kwargs={"imbalance_threshold": cfg.routing.imbalance_threshold,
                                       "max_tracked_prefixes": cfg.routing.max_tracked_prefixes,
                                       "metrics_deployment": "Metrics"}),
            health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=20,
        )
        if pl.placement_group_bundles:
            opts.update(placement_group_bundles=pl.placement_group_bundles,
                        placement_group_strategy=pl.placement_group_strategy)
        prefill[p.name] = PrefillServer.options(**opts).bind(
            p.name, engine_config(cfg, p.model, p.engine, pl, kv), metrics)

    decoders = {}
    for d, dp in zip(cfg.decoders, plan.decoders):
        pl = d.placement
        kv = on_prefill_node = None
        if dp.prefill_module is not None:
            base = cfg.prefill_module(dp.prefill_module)

            def consumer(p):
                return connector_config("consumer", module_ids[dp.prefill_module], p, scope=d.name,
                                        base_dir=str(cfg.path(base.model)), decoder_dir=str(cfg.path(d.model)))
            kv = consumer(consumer_pool)
            if consumer_pool.path != pool.path and cfg.pool.server_resources:
                on_prefill_node = PrefillNodeEngine(
                    dict(cfg.pool.server_resources),
                    engine_config(cfg, d.model, d.engine, pl, consumer(replace(consumer_pool, path=pool.path))))
        opts = dict(
            name=f"Decode-{d.name}", num_replicas=pl.num_replicas, max_ongoing_requests=pl.max_ongoing_requests,
            max_queued_requests=pl.max_queued_requests, **shed,
            ray_actor_options=_actor_options(pl, _engine_env(cfg, pl, d.engine)),
            health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=20,
        )
        # a replica on the prefill's node reads the KV from that node's pool instead of pulling it
        # across nodes; on one node every replica is on it, and the router ranks by load alone
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=NodeAffinityRouter,
            request_router_kwargs={"imbalance_threshold": cfg.routing.imbalance_threshold,
                                   "metrics_deployment": "Metrics"})
        if pl.placement_group_bundles:
            opts.update(placement_group_bundles=pl.placement_group_bundles,
                        placement_group_strategy=pl.placement_group_strategy)
        decoders[d.name] = DecodeServer.options(**opts).bind(d.name, engine_config(cfg, d.model, d.engine, pl, kv),
                                                             metrics, on_prefill_node)

    orch = Orchestrator.options(
        num_replicas=cfg.orchestrator.num_replicas, ray_actor_options={"num_cpus": cfg.orchestrator.num_cpus},
        max_ongoing_requests=cfg.orchestrator.max_ongoing_requests,
        max_queued_requests=cfg.orchestrator.max_queued_requests, **shed,
    ).bind(plan, prefill, decoders, metrics)
    auth = cfg.auth
    if auth.keys_file:  # the Router replica reads the file itself: keys never travel in Serve's config
        auth = auth.model_copy(update={"keys_file": str(cfg.path(auth.keys_file))})
    return Router.options(
        num_replicas=cfg.router.num_replicas, ray_actor_options={"num_cpus": cfg.router.num_cpus},
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        max_queued_requests=cfg.router.max_queued_requests, **shed,
    ).bind(plan, orch, prefill, decoders, metrics, cfg.limits, auth)


def config_from_args(args: dict[str, Any]) -> AppConfig:
    """A Serve application's args: ``{"config": {...}}`` (inline) or ``{"config_path": "file.yaml"}``."""
    if "config_path" in args:
        return load_config(args["config_path"])
    if "config" in args:
        return load_config(args["config"])
    raise ConfigError("application args: give 'config' (inline) or 'config_path'")


def build_app(args: dict[str, Any]):
    """Serve app builder (serve_config.yaml's import_path)."""
    return build(config_from_args(args))
