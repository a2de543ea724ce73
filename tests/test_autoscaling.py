"""Autoscaling from the config down to Serve (no cluster): placement.autoscaling's refusals by field,
the options Serve gets, the engine-load policy's decisions, and the Serve names it relies on."""
from __future__ import annotations

import pytest

from prefillshare.app.config import ENGINE_LOAD_POLICY, ConfigError, load_config
from prefillshare.app.engine_load import EngineLoadMeter, EngineLoadTargets, desired_replicas, load_ratios

AUTO = {"min_replicas": 0, "max_replicas": 3, "upscale_delay_s": 1, "downscale_delay_s": 5}


def _cfg(decoder_placement=None, module_placement=None, **over) -> dict:
    cfg = {"prefill_modules": [{"name": "base", "model": "checkpoints/base"}],
           "decoders": [{"name": "lookup", "model": "checkpoints/decoders/lookup"}]}
    if decoder_placement is not None:
        cfg["decoders"][0]["placement"] = decoder_placement
    if module_placement is not None:
        cfg["prefill_modules"][0]["placement"] = module_placement
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("cfg, field", [
    (_cfg({"num_replicas": 2, "autoscaling": {"max_replicas": 3}}), "decoders[0].placement.num_replicas"),
    (_cfg({"autoscaling": {"min_replicas": 4, "max_replicas": 3}}), "decoders[0].placement.autoscaling.min_replicas"),
    (_cfg({"autoscaling": {"max_replicas": 3, "target_ongoing_requests": 0}}),
     "decoders[0].placement.autoscaling.target_ongoing_requests"),
    (_cfg({"autoscaling": {"max_replicas": 0}}), "decoders[0].placement.autoscaling.max_replicas"),
    (_cfg({"autoscaling": {"max_replicas": 2, "initial_replicas": 3}}),
     "decoders[0].placement.autoscaling.initial_replicas"),
    (_cfg(module_placement={"num_cpus": 0.5, "autoscaling": {"min_replicas": 0, "max_replicas": 2}}),
     "prefill_modules[0].placement.autoscaling.min_replicas"),
    (_cfg(router={"autoscaling": {"min_replicas": 0, "max_replicas": 2}}), "router.autoscaling.min_replicas"),
    (_cfg(orchestrator={"autoscaling": {"min_replicas": 0, "max_replicas": 2}}),
     "orchestrator.autoscaling.min_replicas"),
    (_cfg(metrics={"autoscaling": {"max_replicas": 2}}), "metrics"),
    (_cfg({"autoscaling": {"max_replicas": 2, "policy": {"policy_kwargs": {"first_token_target": 1}}}}),
     "decoders[0].placement.autoscaling.policy.policy_kwargs"),
    (_cfg({"autoscaling": {"max_replicas": 2, "policy": {"policy_kwargs": {"inter_token_target_s": -1}}}}),
     "decoders[0].placement.autoscaling.policy.policy_kwargs"),
    (_cfg({"autoscaling": {"max_replicas": 2, "max_replicas_typo": 3}}),
     "decoders[0].placement.autoscaling.max_replicas_typo"),
])
def test_a_bad_autoscaling_config_fails_the_build_naming_the_field(cfg, field):
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert str(e.value).startswith(field + ":") or f"; {field}:" in str(e.value), str(e.value)


def test_a_decoder_may_start_from_zero_and_serve_gets_autoscaling_config_without_num_replicas():
    from prefillshare.deployments.application import _small, engine_bounds, engine_options

    cfg = load_config(_cfg({"num_cpus": 0.25, "autoscaling": {**AUTO, "policy": {}}},
                           router={"autoscaling": {"min_replicas": 1, "max_replicas": 2}}))
    d = cfg.decoders[0]
    opts = engine_options(cfg, "Decode-lookup", d.placement, d.engine)
    assert "num_replicas" not in opts
    auto = opts["autoscaling_config"]
    assert auto["min_replicas"] == 0 and auto["max_replicas"] == 3 and "target_ongoing_requests" not in auto
    assert auto["policy"]["policy_function"] == ENGINE_LOAD_POLICY
    from ray.serve.config import AutoscalingConfig

    assert AutoscalingConfig(**auto).max_replicas == 3  # Serve takes it as given (the policy imports)
    router = _small(cfg, cfg.router)
    assert router["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2} and "num_replicas" not in router
    assert d.placement.start_replicas == 0 and cfg.prefill_modules[0].placement.start_replicas == 1
    bounds = engine_bounds(cfg)
    assert bounds["Decode-lookup"].min_replicas == 0 and bounds["Decode-lookup"].autoscaled
    assert bounds["Prefill-base"].max_replicas == 1 and not bounds["Prefill-base"].autoscaled


def test_the_default_app_autoscales_its_decoders():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parent.parent / "serve_config.yaml")
    assert cfg.decoders and all(d.placement.autoscaling is not None for d in cfg.decoders)


# --- the engine-load policy --------------------------------------------------------------------

def test_the_first_token_target_reads_the_queue_before_any_first_token_is_out():
    t = EngineLoadTargets(first_token_target_s=1.0)
    # a burst: 8,000 prompt tokens queued at 2,000 tokens/s predict 4 s, though the last TTFT was 0.2 s
    stats = {"first_token_s": {"a": 0.2}, "queued_prompt_tokens": {"a": 8000.0}, "prefill_tokens_per_s": {"a": 2000.0}}
    ratios = load_ratios(stats, t)
    assert ratios["first_token_s"] == pytest.approx(4.0)
    assert desired_replicas(1, ratios) == (4, "first_token_s")


def test_the_inter_token_target_sizes_a_decoder_and_the_largest_ratio_decides():
    t = EngineLoadTargets(inter_token_target_s=0.05, max_kv_cache_usage=0.8)
    stats = {"inter_token_s": {"a": 0.09, "b": 0.07}, "kv_cache_usage": {"a": 0.2, "b": 0.2}}
    ratios = load_ratios(stats, t)
    assert ratios["inter_token_s"] == pytest.approx(1.6) and ratios["kv_cache_usage"] == pytest.approx(0.25)
    assert desired_replicas(2, ratios) == (4, "inter_token_s")
    full = {"inter_token_s": {"a": 0.01}, "kv_cache_usage": {"a": 0.96}}
    assert desired_replicas(1, load_ratios(full, t)) == (2, "kv_cache_usage")


def test_an_idle_deployment_wants_none_and_a_quiet_one_fewer():
    t = EngineLoadTargets(inter_token_target_s=0.05)
    assert desired_replicas(3, load_ratios({}, t)) == (0, None)
    assert desired_replicas(3, load_ratios({"inter_token_s": {"a": 0.02}}, t))[0] == 2


def test_ongoing_requests_are_an_optional_signal_of_the_same_policy():
    t = EngineLoadTargets(target_ongoing_requests=2, max_kv_cache_usage=None)
    assert load_ratios({}, t, ongoing_requests=10, replicas=2) == {"ongoing_requests": 2.5}


def test_the_policy_reads_serves_context():
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from prefillshare.deployments.autoscaling import EngineLoadPolicy

    def ctx(current, target, metrics, total=0.0):
        return AutoscalingContext(
            deployment_id=None, deployment_name="Decode-x", app_name="app", current_num_replicas=current,
            target_num_replicas=target, running_replicas=[], total_num_requests=total, total_queued_requests=0.0,
            aggregated_metrics=lambda: metrics, raw_metrics=None, capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=4, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
            current_time=None, config=AutoscalingConfig(min_replicas=1, max_replicas=4))

    policy = EngineLoadPolicy(inter_token_target_s=0.05)
    want, state = policy(ctx(2, 2, {"inter_token_s": {"r1": 0.1, "r2": 0.1}}))
    assert want == 4 and state["last_signal"] == "inter_token_s"
    assert policy(ctx(0, 0, {}))[0] == 0  # nothing reports at zero: Serve's own jump from zero decides


def test_serve_instantiates_a_class_policy_with_its_kwargs_and_passes_its_answer_on():
    """Canary for Ray 2.60's handling this policy relies on: a class is built once with policy_kwargs,
    Serve's wrapper passes its answer on (delays applied), and the deployment's state clips it to
    max_replicas (``apply_bounds``)."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable  # noqa: PLC2701 - canary
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

    from prefillshare.deployments.autoscaling import EngineLoadPolicy

    policy = AutoscalingPolicy(policy_function=ENGINE_LOAD_POLICY, policy_kwargs={"inter_token_target_s": 0.05})
    fn = _resolve_policy_callable(policy)
    assert type(fn).__name__ == EngineLoadPolicy.__name__ and fn.targets.inter_token_target_s == 0.05
    config = AutoscalingConfig(min_replicas=1, max_replicas=3, upscale_delay_s=0)
    ctx = AutoscalingContext(
        deployment_id=None, deployment_name="Decode-x", app_name="app", current_num_replicas=1, target_num_replicas=1,
        running_replicas=[], total_num_requests=1.0, total_queued_requests=0.0,
        aggregated_metrics={"inter_token_s": {"r1": 0.5}}, raw_metrics=None, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=3, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=None, config=config)
    want, _ = _apply_autoscaling_config(fn)(ctx)
    assert want == 10  # 10x the target
    from ray.serve._private.autoscaling_state import DeploymentAutoscalingState  # noqa: PLC2701 - canary

    assert callable(DeploymentAutoscalingState.apply_bounds)


def test_a_replica_reports_what_its_engine_did_since_the_last_report():
    from prometheus_client import CollectorRegistry, Gauge, Histogram

    r = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "", registry=r).set(3)
    Gauge("vllm:kv_cache_usage_perc", "", registry=r).set(0.4)
    ttft = Histogram("vllm:time_to_first_token_seconds", "", registry=r)
    computed = Histogram("vllm:request_prefill_kv_computed_tokens", "", registry=r)
    prefill_time = Histogram("vllm:request_prefill_time_seconds", "", registry=r)
    meter = EngineLoadMeter(r)
    ttft.observe(1.0)
    ttft.observe(3.0)
    computed.observe(1000)
    prefill_time.observe(0.5)
    first = meter.sample(queued_prompt_tokens=700)
    assert first["waiting"] == 3 and first["kv_cache_usage"] == 0.4 and first["queued_prompt_tokens"] == 700
    assert first["first_token_s"] == pytest.approx(2.0) and first["prefill_tokens_per_s"] == pytest.approx(2000)
    assert "inter_token_s" not in first  # no decode step produced one
    ttft.observe(0.5)
    assert meter.sample(0)["first_token_s"] == pytest.approx(0.5)  # the interval's mean, not the lifetime's
    assert "first_token_s" not in meter.sample(0)


def test_a_new_prefill_replica_takes_new_contexts_and_leaves_cached_ones_where_they_are():
    """Growing keeps what is cached: contexts this router sent stay on their replica; of contexts it
    never saw (sent by another router) rendezvous moves only the share the new replica should take."""
    from prefillshare.deployments.routing.locality import locality_keys
    from prefillshare.deployments.routing.prefix_router import LocalityTable, choose

    table = LocalityTable()
    contexts = [locality_keys("pm", list(range(i * 100, i * 100 + 64)), 16) for i in range(600)]
    before = {}
    for keys in contexts:
        (first, *_), _ = choose(keys, ["a", "b"], lambda r: 0, table, 4)
        before[keys[0]] = first[0]
        table.record(keys, first[0])
    assert all(choose(k, ["a", "b", "c"], lambda r: 0, table, 4)[0][0] == [before[k[0]]] for k in contexts)
    unseen = LocalityTable()  # another router's view: it never sent these contexts
    after = {k[0]: choose(k, ["a", "b", "c"], lambda r: 0, unseen, 4)[0][0][0] for k in contexts}
    moved = [k for k in after if after[k] != before[k]]
    assert all(after[k] == "c" for k in moved)  # a context moves only to the new replica
    assert 0.25 < len(moved) / len(contexts) < 0.42  # about a third: the new replica's share, not all
