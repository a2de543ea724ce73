"""The engines' vllm:* metrics on the app's /metrics, without Ray: what a replica sends
(prefillshare.deployments.metrics.engine_samples) and how the Metrics deployment exports it."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from prefillshare.deployments import metrics
from prefillshare.deployments.metrics import AppMetrics, engine_samples


def _engine_registry(path: str) -> CollectorRegistry:
    """What vLLM's stat logger registers in an engine replica (its names and labels)."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    Counter("vllm:prompt_tokens", "prompt tokens", labels, registry=r).labels(path, "0").inc(40)
    h = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=(0.1, 1.0), registry=r)
    h.labels(path, "0").observe(0.05)
    Counter("other_total", "not vLLM's", registry=r).inc()
    return r


def test_a_replica_sends_only_vllm_families_named_by_the_served_model():
    fams = engine_samples("alpha", _engine_registry("/models/alpha"))
    assert {f[0] for f in fams} == {"vllm:prompt_tokens", "vllm:time_to_first_token_seconds"}
    assert all(labels["model_name"] == "alpha" for _, _, _, samples in fams for _, labels, _ in samples)


def test_metrics_export_each_replicas_samples_labelled_by_deployment_and_replica():
    m = AppMetrics()
    m.engines.update(("Decode-alpha", "r1"), engine_samples("alpha", _engine_registry("/m/a")))
    m.engines.update(("Decode-alpha", "r2"), engine_samples("alpha", _engine_registry("/m/a")))
    m.engines.update(("Prefill-base", "p1"), engine_samples("base", _engine_registry("/m/b")))
    text = m.render().decode()
    assert text.count("# TYPE vllm:prompt_tokens") == 1  # one family, every replica's samples
    for replica in ("r1", "r2"):
        assert f'vllm:prompt_tokens_total{{deployment="Decode-alpha",engine="0",model_name="alpha",replica="{replica}"}}' \
            ' 40.0' in text
    assert 'vllm:time_to_first_token_seconds_bucket{' in text and 'replica="p1"' in text
    assert "other_total" not in text


def test_a_silent_replica_drops_out(monkeypatch):
    m = AppMetrics()
    m.engines.update(("Decode-alpha", "gone"), engine_samples("alpha", _engine_registry("/m/a")))
    now = metrics.time.monotonic()
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now + metrics.ENGINE_STALE_S + 1)
    assert "vllm:" not in generate_latest(m.registry).decode()


def test_engines_built_at_once_in_one_process_do_not_collide_in_the_registry(tmp_path, monkeypatch):
    """vLLM's Prometheus stat logger first unregisters every vllm:* collector and then registers
    its own; two engines started at once (threads of Engine.start) once interleaved there and one
    start failed with DuplicateTimeseries. The window is widened here so that it always opens: vLLM's
    own logger collides, the engine's (built under a lock) does not. The same holds for the info
    gauge each one registers once its engine is up."""
    import threading
    import time

    import vllm.v1.metrics.loggers as vllm_loggers

    from bench.random_models import make_models
    from prefillshare.app.engine.async_engine import EngineConfig, _prometheus_stat_logger

    base = make_models(tmp_path, {})["base"]
    vllm_config = EngineConfig(model=str(base), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256,
                               block_size=16, skip_tokenizer_init=True).engine_args().create_engine_config()
    unregister = vllm_loggers.unregister_vllm_metrics

    def unregister_then_yield():
        unregister()
        time.sleep(0.2)  # the other threads run between the unregister and the registrations

    monkeypatch.setattr(vllm_loggers, "unregister_vllm_metrics", unregister_then_yield)

    def build_at_once(cls) -> list[str]:
        errors: list[str] = []

        def build():
            try:
                cls(vllm_config, [0])
            except Exception as e:  # noqa: BLE001 - the test counts every failure
                errors.append(type(e).__name__)

        threads = [threading.Thread(target=build) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors

    assert build_at_once(vllm_loggers.PrometheusStatLogger)  # the race this guards against
    assert build_at_once(_prometheus_stat_logger()) == []

    def both_come_up(cls) -> list[str]:
        """Two engines built, then each one up: each registers the cache-config info gauge."""
        loggers = [cls(vllm_config, [0]), cls(vllm_config, [0])]
        errors = []
        for logger in loggers:
            try:
                logger.log_engine_initialized()
            except ValueError as e:  # prometheus_client: Duplicated timeseries
                errors.append(str(e))
        return errors

    assert [e for e in both_come_up(vllm_loggers.PrometheusStatLogger) if "vllm:cache_config_info" in e]
    assert both_come_up(_prometheus_stat_logger()) == []
