"""The engines' vllm:* metrics on the app's /metrics, without Ray: what a replica sends
(deployments.metrics.engine_samples) and how the Metrics deployment exports it."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from deployments import metrics
from deployments.metrics import AppMetrics, engine_samples


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
