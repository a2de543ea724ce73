"""Builds the Ray Serve application from an AppConfig (serve_config.yaml's import_path).

Resolution happens here, once, before any engine starts: each decoder is matched to the
prefill module its manifest names and checked for compatibility; a decoder that cannot
share gets private prefill with a readable reason. A decode group (a decoder entry with
``adapters``) is one engine on the base serving each LoRA adapter under its own name; an
adapter that cannot run there fails the build, naming the field. Then one PrefillServer
deployment per prefill module (prefix-locality router), one DecodeServer deployment per
decoder or decode group (own placement-group bundles), the Orchestrator, the Metrics holder
and the Router ingress.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.config import (
    AppConfig,
    ConfigError,
    DecoderConfig,
    EngineSettings,
    LoRAGroup,
    Placement,
    PrefillModuleConfig,
    load_config,
)
from app.engine import compute_dtype
from deployments.messages import AppPlan, DecoderPlan, ModulePlan
from deployments.prompts import decoder_renderers

log = logging.getLogger("ray.serve")

def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes of K and V over all layers for one token (what a decoder loads per shared token)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * int(cfg["num_hidden_layers"]) * int(heads) * int(head_dim) * compute_dtype.BYTES[compute_dtype.resolve(dtype)]


def _private(d: DecoderConfig, name: str, bpt: int, code: str, detail: str, **lora) -> DecoderPlan:
    log.warning("decoder %s: private prefill (%s)", name, detail)
    return DecoderPlan(name, None, code, detail, bpt, d.engine.max_model_len, **lora)


def _engine_mismatch(base: PrefillModuleConfig, d: DecoderConfig) -> list[str]:
    reasons = []
    if base.engine.block_size != d.engine.block_size:
        reasons.append(f"block_size differs: prefill module {base.engine.block_size}, decoder {d.engine.block_size}")
    if base.engine.dtype != d.engine.dtype:
        reasons.append(f"engine dtype differs: prefill module {base.engine.dtype}, decoder {d.engine.dtype}")
    return reasons


def _module_for(manifest_id: str, wanted: str | None, module_ids: dict[str, str]) -> str | None:
    """The configured module a decoder consumes: ``wanted`` by name, or by the manifest's id for 'auto'."""
    if wanted != "auto":
        return wanted
    return next((n for n, i in module_ids.items() if i == manifest_id), None)


def resolve_decoder(cfg: AppConfig, d: DecoderConfig, module_ids: dict[str, str]) -> DecoderPlan:
    """Which prefill module feeds full-weight decoder ``d``, or (code, readable reason) for private prefill."""
    from app.models import compat
    from app.models.identity import CheckpointError
    from app.models.manifest import ManifestError, read_manifest

    path = cfg.path(d.model)
    bpt = kv_bytes_per_token(path, d.engine.dtype)
    if d.prefill_module is None:
        return _private(d, d.name, bpt, "disabled", "prefill_module is null in the config")
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        return _private(d, d.name, bpt, "no_manifest", str(e))
    name = _module_for(manifest.prefill_module_id, d.prefill_module, module_ids)
    if name is None:
        return _private(d, d.name, bpt, "no_prefill_module",
                        f"manifest names prefill module {manifest.prefill_module_id}; configured: {module_ids}")
    base = cfg.prefill_module(name)
    try:
        verdict = compat.check(cfg.path(base.model), path, base_id=module_ids[name])
    except (ManifestError, CheckpointError) as e:
        return _private(d, d.name, bpt, "incompatible", str(e))
    reasons = list(verdict.reasons) + _engine_mismatch(base, d)
    if reasons:
        return _private(d, d.name, bpt, "incompatible", "; ".join(reasons))
    return DecoderPlan(d.name, name, None, None, bpt, d.engine.max_model_len)


def resolve_group(cfg: AppConfig, i: int, d: DecoderConfig, module_ids: dict[str, str]) -> list[DecoderPlan]:
    """One plan per adapter of decode group ``d`` (config ``decoders[i]``).

    An adapter that cannot run on the group's engine (no manifest, not an adapter, files that
    disagree with the manifest or the config, trained on another base) fails the deploy with
    the field named: nothing starts. One that runs but cannot use the shared KV prefills
    privately with the reason, like a full-weight decoder.
    """
    from app.models import compat
    from app.models.identity import CheckpointError, prefill_module_id
    from app.models.manifest import ManifestError, read_manifest

    path = cfg.path(d.model)
    bpt = kv_bytes_per_token(path, d.engine.dtype)
    group_id = prefill_module_id(path)
    plans, modules = [], set()
    for j, a in enumerate(d.adapters):
        where = f"decoders[{i}].adapters[{j}]"
        adir = cfg.path(a.path)
        try:
            manifest = read_manifest(adir)
        except ManifestError as e:
            raise ConfigError(f"{where}.path: {e}") from None
        if manifest.adapter is None:
            raise ConfigError(f"{where}.path: {adir} is not an adapter-only decoder (its manifest has no 'adapter' "
                              "block); serve a full checkpoint as its own decoder instead")
        if manifest.adapter.rank != a.rank:
            raise ConfigError(f"{where}.rank: {a.rank} in the config, the adapter's manifest says {manifest.adapter.rank}")
        try:
            compat.check_adapter_files(adir, manifest.adapter)
        except CheckpointError as e:
            raise ConfigError(f"{where}.path: {e}") from None
        if manifest.adapter.base_prefill_module_id != group_id:
            raise ConfigError(f"{where}.path: adapter {a.name!r} belongs to base {manifest.adapter.base_prefill_module_id},"
                              f" the group's model {d.model} is {group_id} (an adapter only runs on the weights it "
                              "was trained on)")
        lora = {"group": d.name, "adapter": a.name}
        if d.prefill_module is None:
            plans.append(_private(d, a.name, bpt, "disabled", "prefill_module is null in the config", **lora))
            continue
        name = _module_for(manifest.prefill_module_id, d.prefill_module, module_ids)
        if name is None:
            plans.append(_private(d, a.name, bpt, "no_prefill_module", f"manifest names prefill module "
                                  f"{manifest.prefill_module_id}; configured: {module_ids}", **lora))
            continue
        base = cfg.prefill_module(name)
        try:
            reasons = list(compat.check(cfg.path(base.model), adir, base_id=module_ids[name]).reasons)
        except (ManifestError, CheckpointError) as e:
            reasons = [str(e)]
        reasons += _engine_mismatch(base, d)
        own = None
        if base.adapters:  # a per-adapter prefill: this adapter's own KV, computed there with the same adapter
            own = next((b.name for b in base.adapters if b.name == a.name), None)
            if own is None:
                reasons.append(f"prefill module {name} computes per-adapter KV and holds no adapter named {a.name!r}")
        if reasons:
            plans.append(_private(d, a.name, bpt, "incompatible", "; ".join(reasons), **lora))
            continue
        modules.add(name)
        plans.append(DecoderPlan(a.name, name, None, None, bpt, d.engine.max_model_len, prefill_adapter=own, **lora))
    if len(modules) > 1:
        raise ConfigError(f"decoders[{i}].adapters: one decode group reads one prefill module's KV; its adapters "
                          f"name {sorted(modules)} (split them into groups or set decoders[{i}].prefill_module)")
    return plans


def plan_app(cfg: AppConfig) -> tuple[AppPlan, dict[str, str]]:
    """The resolved plan and each prefill module's id; raises ConfigError before any engine starts."""
    from app.models.identity import prefill_module_id

    cfg.check_paths()
    module_ids = {p.name: prefill_module_id(cfg.path(p.model)) for p in cfg.prefill_modules}
    modules = tuple(ModulePlan(p.name, module_ids[p.name], p.engine.block_size) for p in cfg.prefill_modules)
    decoders: list[DecoderPlan] = []
    for i, d in enumerate(cfg.decoders):
        decoders += resolve_group(cfg, i, d, module_ids) if d.adapters else [resolve_decoder(cfg, d, module_ids)]
    tools = _tool_call_formats(cfg)
    decoders = [replace(dp, tool_call_format=tools.get(dp.name)) for dp in decoders]
    lim = cfg.limits
    plan = AppPlan(str(cfg.path(cfg.tokenizer)), modules, tuple(decoders), lim.max_tokens_default,
                   lim.max_tokens_cap, lim.max_agents, lim.max_rounds, lim.request_timeout_s, lim.prefill_wait_s,
                   renderers=decoder_renderers(cfg))
    return plan, module_ids


def _tool_call_formats(cfg: AppConfig) -> dict[str, str]:
    """{served decoder name: the tool-call format its manifest declares} (deployments/tools.py)."""
    from app.models.manifest import ManifestError, read_manifest

    out = {}
    for d in cfg.decoders:
        for name, path in ([(a.name, a.path) for a in d.adapters] if d.adapters else [(d.name, d.model)]):
            try:
                fmt = read_manifest(cfg.path(path)).tool_call_format
            except ManifestError:
                continue
            if fmt is not None:
                out[name] = fmt
    return out


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


def engine_options(cfg: AppConfig, name: str, p: Placement, eng: EngineSettings, **extra) -> dict[str, Any]:
    """Serve options of an engine deployment (prefill or decode alike)."""
    from ray.serve.config import BackpressureConfig

    actor: dict[str, Any] = {"num_cpus": p.num_cpus, "runtime_env": {"env_vars": engine_env(cfg, p, eng)}}
    if p.num_gpus:
        actor["num_gpus"] = p.num_gpus
    opts: dict[str, Any] = dict(
        name=name, num_replicas=p.num_replicas, max_ongoing_requests=p.max_ongoing_requests,
        max_queued_requests=p.max_queued_requests, ray_actor_options=actor,
        # Serve's own shedding (max_queued_requests) answers 429 + Retry-After like the Router does.
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=cfg.limits.retry_after_s),
        health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=20, **extra)
    if p.placement_group_bundles:
        opts.update(placement_group_bundles=p.placement_group_bundles, placement_group_strategy=p.placement_group_strategy)
    return opts


def pool_specs(cfg: AppConfig):
    """(producer pool, consumer pool): producers always write their node's shared-memory pool;
    with transport 'nixl' consumers fill their own node's pool from the block servers."""
    return cfg.pool.specs()


def _small(cfg: AppConfig, d) -> dict[str, Any]:
    """Serve options of a deployment without an engine (Router, Orchestrator)."""
    from ray.serve.config import BackpressureConfig

    return dict(num_replicas=d.num_replicas, ray_actor_options={"num_cpus": d.num_cpus},
                max_ongoing_requests=d.max_ongoing_requests, max_queued_requests=d.max_queued_requests,
                backpressure_config=BackpressureConfig(status_code=429, retry_after_s=cfg.limits.retry_after_s))


def build(cfg: AppConfig):
    """The Serve application (the Router ingress with everything bound beneath it)."""
    from ray.serve.config import RequestRouterConfig

    from app.engine.async_engine import connector_config
    from deployments.decode import DecodeServer, PrefillNodeEngine
    from deployments.metrics import MetricsServer
    from deployments.node_router import NodeAffinityRouter
    from deployments.orchestrator import Orchestrator
    from deployments.prefill import PrefillServer
    from deployments.prefix_router import PrefixLocalityRouter
    from deployments.router import Router

    plan, module_ids = plan_app(cfg)
    pool, consumer_pool = pool_specs(cfg)

    metrics = MetricsServer.options(
        num_replicas=1, ray_actor_options={"num_cpus": cfg.metrics.num_cpus},
        max_ongoing_requests=cfg.metrics.max_ongoing_requests,
    ).bind(cfg.pool.path if cfg.pool.transport == "shm" else None)

    prefill = {}
    for p in cfg.prefill_modules:
        kv = connector_config("producer", module_ids[p.name], pool, scope=p.name, adapter_keys=bool(p.adapters))
        router = RequestRouterConfig(
            request_router_class=PrefixLocalityRouter,
            request_router_kwargs={"imbalance_threshold": cfg.routing.imbalance_threshold,
                                   "max_tracked_prefixes": cfg.routing.max_tracked_prefixes,
                                   "metrics_deployment": "Metrics"})
        prefill[p.name] = PrefillServer.options(
            **engine_options(cfg, f"Prefill-{p.name}", p.placement, p.engine, request_router_config=router)
        ).bind(p.name, engine_config(cfg, p.model, p.engine, p.placement, kv, p), metrics)

    decoders = {}
    by_name = {dp.name: dp for dp in plan.decoders}
    for d in cfg.decoders:
        pl = d.placement
        served = [by_name[n] for n in d.served_names]
        module = next((dp.prefill_module for dp in served if dp.prefill_module is not None), None)
        kv = on_prefill_node = None
        if module is not None:
            base = cfg.prefill_module(module)
            # a full decoder's compatibility is checked once more inside the engine; a group's was checked above
            dirs = {} if d.adapters else dict(base_dir=str(cfg.path(base.model)), decoder_dir=str(cfg.path(d.model)))

            def consumer(pool_spec, module=module, base=base, dirs=dirs, d=d):
                return connector_config("consumer", module_ids[module], pool_spec, scope=d.name,
                                        adapter_keys=bool(base.adapters), **dirs)
            kv = consumer(consumer_pool)
            if consumer_pool.path != pool.path and cfg.pool.server_resources:
                on_prefill_node = PrefillNodeEngine(
                    dict(cfg.pool.server_resources),
                    engine_config(cfg, d.model, d.engine, pl, consumer(replace(consumer_pool, path=pool.path)), d))
        # a replica on the prefill's node reads the KV from that node's pool instead of pulling it
        # across nodes; on one node every replica is on it, and the router ranks by load alone
        extra = {"request_router_config": RequestRouterConfig(
            request_router_class=NodeAffinityRouter,
            request_router_kwargs={"imbalance_threshold": cfg.routing.imbalance_threshold,
                                   "metrics_deployment": "Metrics"})}
        handle = DecodeServer.options(**engine_options(cfg, f"Decode-{d.name}", pl, d.engine, **extra)).bind(
            d.name, engine_config(cfg, d.model, d.engine, pl, kv, d), metrics, on_prefill_node)
        for dp in served:  # a decode group serves each adapter's name through its one engine
            decoders[dp.name] = handle

    # one set of decode handles for both callers: the Router streams completions from them, the
    # Orchestrator streams agent runs' decoders
    orch = Orchestrator.options(**_small(cfg, cfg.orchestrator)).bind(plan, prefill, decoders, metrics)
    auth = cfg.auth
    if auth.keys_file:  # the Router replica reads the file itself: keys never travel in Serve's config
        auth = auth.model_copy(update={"keys_file": str(cfg.path(auth.keys_file))})
    return Router.options(**_small(cfg, cfg.router)).bind(plan, orch, prefill, decoders, metrics, cfg.limits, auth)


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
