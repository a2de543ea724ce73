"""Builds the Ray Serve application from an AppConfig (serve_config.yaml's import_path).

The plan (app/plan.py) is resolved first, before any engine starts. Then: one PrefillServer
deployment per prefill module (prefix-locality router; it also serves the module's in-engine LoRA
decoders), one DecodeServer deployment per decoder or decode group (its own placement-group
bundles, node-affinity router), the Orchestrator, the Metrics holder and the Router ingress. The plan's hand-over (app/engine/handover.py) gives each
engine's connector config and goes to every engine replica whole.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefillshare.app.config import AppConfig, EngineSettings, Placement, SmallDeployment, config_from_args
from prefillshare.app.engine import alloc_conf
from prefillshare.app.engine.handover import ModuleLink
from prefillshare.app.engine_args import engine_config, engine_env
from prefillshare.app.plan import AppPlan, plan_app
from prefillshare.deployments.fleet import ReplicaBounds


def engine_options(cfg: AppConfig, name: str, p: Placement, eng: EngineSettings, **extra) -> dict[str, Any]:
    """Serve options of an engine deployment (prefill or decode alike)."""
    from ray.serve.config import BackpressureConfig

    from prefillshare.deployments.ray_internals import REPLICA_ENV  # Serve's settings of a request-path replica

    actor: dict[str, Any] = {"num_cpus": p.num_cpus,
                             "runtime_env": {"env_vars": {**REPLICA_ENV, **engine_env(cfg, p, eng)}}}
    if p.num_gpus:
        actor["num_gpus"] = p.num_gpus
    opts: dict[str, Any] = dict(
        name=name, **p.replica_options(), max_ongoing_requests=p.max_ongoing_requests,
        max_queued_requests=p.max_queued_requests, ray_actor_options=actor,
        # Serve's own shedding (max_queued_requests) answers 429 + Retry-After like the Router does.
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=cfg.limits.retry_after_s),
        health_check_period_s=10, health_check_timeout_s=60,
        # a replica stopped by a downscale (or a redeploy) finishes what it was given: no admitted
        # request outlives limits.request_timeout_s, so none is cut
        graceful_shutdown_timeout_s=max(20.0, cfg.limits.request_timeout_s), **extra)
    if p.placement_group_bundles:
        opts.update(placement_group_bundles=p.placement_group_bundles, placement_group_strategy=p.placement_group_strategy)
    return opts


def _small(cfg: AppConfig, d) -> dict[str, Any]:
    """Serve options of a deployment without an engine (Router, Orchestrator)."""
    from ray.serve.config import BackpressureConfig

    from prefillshare.deployments.ray_internals import REPLICA_ENV

    return dict(**d.replica_options(),
                ray_actor_options={"num_cpus": d.num_cpus, "runtime_env": {"env_vars": dict(REPLICA_ENV)}},
                max_ongoing_requests=d.max_ongoing_requests, max_queued_requests=d.max_queued_requests,
                backpressure_config=BackpressureConfig(status_code=429, retry_after_s=cfg.limits.retry_after_s))


def _deployment(cls: type) -> Any:
    """``cls`` as the Serve ``Deployment`` that ``@serve.deployment`` made it (mypy keeps a decorated
    class's own type, so ``.options`` would not resolve)."""
    return cls


def _router_config(cls, cfg: AppConfig, **kwargs):
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=cls, request_router_kwargs={
        "imbalance_threshold": cfg.routing.imbalance_threshold, "metrics_deployment": "Metrics", **kwargs})


def _prefill_deployments(cfg: AppConfig, plan: AppPlan, metrics) -> dict:
    from prefillshare.deployments.replicas.prefill import PrefillServer
    from prefillshare.deployments.routing.prefix_router import PrefixLocalityRouter

    handover = plan.handover
    assert handover is not None, "plan_app builds the hand-over"
    prefill = {}
    for p in cfg.prefill_modules:
        link = ModuleLink(plan.module(p.name).module_id, p.name, adapter_keys=bool(p.adapters))
        kv = handover.transfer_config("producer", link, on_gpu=bool(p.placement.num_gpus))
        # a prefill engine caches prefixes in every mode: later prompts of a fan-out reuse the context
        ec = replace(engine_config(cfg, p.model, p.engine, p.placement, kv, p), enable_prefix_caching=True)
        alloc_conf.check(ec.extra_env, kv, ec.engine_kwargs, where=f"prefill_modules {p.name}")
        router = _router_config(PrefixLocalityRouter, cfg, max_tracked_prefixes=cfg.routing.max_tracked_prefixes)
        prefill[p.name] = _deployment(PrefillServer).options(
            **engine_options(cfg, f"Prefill-{p.name}", p.placement, p.engine, request_router_config=router)
        ).bind(p.name, ec, handover, metrics)
    return prefill


def _decode_deployments(cfg: AppConfig, plan: AppPlan, metrics) -> dict:
    """{served name: its decode deployment}; a decode group serves each adapter's name through its one engine."""
    from prefillshare.deployments.replicas.decode import DecodeServer
    from prefillshare.deployments.routing.node_router import NodeAffinityRouter

    decoders = {}
    for d in cfg.decoders:
        pl = d.placement
        served = [plan.decoder(n) for n in d.served_names]
        module = next((dp.prefill_module for dp in served if dp.prefill_module is not None), None)
        # the plan checked compatibility (prefillshare.app.models.compat): a decoder without a module runs
        # without a connector and prefills privately
        handover = plan.handover if module is not None else None
        kv = None
        if handover is not None and module is not None:
            link = ModuleLink(plan.module(module).module_id, d.name,
                              adapter_keys=bool(cfg.prefill_module(module).adapters))
            kv = handover.transfer_config("consumer", link, on_gpu=bool(pl.num_gpus))
        # a replica on the prefill's node is preferred (the KV does not cross nodes); on one node
        # every replica is on it, and the router ranks by load alone
        extra = {"request_router_config": _router_config(NodeAffinityRouter, cfg)}
        ec = engine_config(cfg, d.model, d.engine, pl, kv, d)
        alloc_conf.check(ec.extra_env, kv, ec.engine_kwargs, where=f"decoders {d.name}")
        if kv is not None:
            # a consumer's local cache could hold KV it computed itself after a fallback: off
            ec = replace(ec, enable_prefix_caching=False)
        handle = _deployment(DecodeServer).options(**engine_options(cfg, f"Decode-{d.name}", pl, d.engine, **extra)).bind(
            d.name, ec, handover, metrics)
        for dp in served:
            decoders[dp.name] = handle
    return decoders


def _bounds(r: Placement | SmallDeployment, engine: bool = True) -> ReplicaBounds:
    return ReplicaBounds(r.min_replicas, r.max_replicas, r.autoscaling is not None, engine)


def engine_bounds(cfg: AppConfig) -> dict[str, ReplicaBounds]:
    """{Serve deployment name: its replica bounds} of the engines the Router calls (the prefill
    modules, the decoders): deployments/fleet.py follows them (admission's hold, cold decoders)."""
    out = {f"Prefill-{p.name}": _bounds(p.placement) for p in cfg.prefill_modules}
    out.update({f"Decode-{d.name}": _bounds(d.placement) for d in cfg.decoders})
    return out


def build(cfg: AppConfig):
    """The Serve application (the Router ingress with everything bound beneath it)."""
    from prefillshare.deployments.ingress.server import Router
    from prefillshare.deployments.metrics import MetricsServer
    from prefillshare.deployments.path.orchestrator import Orchestrator

    plan = plan_app(cfg)
    metrics = _deployment(MetricsServer).options(
        num_replicas=1, ray_actor_options={"num_cpus": cfg.metrics.num_cpus},
        max_ongoing_requests=cfg.metrics.max_ongoing_requests,
    ).bind(plan.handover)
    prefill = _prefill_deployments(cfg, plan, metrics)
    decoders = _decode_deployments(cfg, plan, metrics)
    # an in-engine LoRA decoder streams from its prefill module's deployment (EngineHost.generate)
    decoders.update({dp.name: prefill[dp.prefill_module] for dp in plan.decoders if dp.in_engine})
    # one set of decode handles for both callers: the Router streams completions from them, the
    # Orchestrator streams agent runs' decoders
    bounds = engine_bounds(cfg)
    orch = _deployment(Orchestrator).options(**_small(cfg, cfg.orchestrator)).bind(plan, prefill, decoders, metrics,
                                                                                   bounds)
    # the Router's fleet also shows the two small deployments on /metrics (their loss holds nothing)
    shown = {"Router": _bounds(cfg.router, engine=False), "Orchestrator": _bounds(cfg.orchestrator, engine=False)}
    auth = cfg.auth
    if auth.keys_file:  # the Router replica reads the file itself: keys never travel in Serve's config
        auth = auth.model_copy(update={"keys_file": str(cfg.path(auth.keys_file))})
    return _deployment(Router).options(**_small(cfg, cfg.router)).bind(plan, orch, prefill, decoders, metrics, auth,
                                                                       {**bounds, **shown})


def build_app(args: dict[str, Any]):
    """Serve app builder (serve_config.yaml's import_path)."""
    return build(config_from_args(args))
