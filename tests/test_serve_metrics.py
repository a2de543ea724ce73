"""The metrics registry without Ray: what one request record and the KV pool's counters become."""
from __future__ import annotations

import pytest

from prefillshare.deployments.messages import PrefillRecord, RequestRecord
from prefillshare.deployments.metrics import AppMetrics


def _pool_mode(path: str):
    """The pool mode's hand-over: the Metrics replica reads its node's pool at ``path``."""
    from prefillshare.app.engine.pool.handover import PoolHandover
    from prefillshare.app.engine.pool.kv_pool import PoolSpec

    return PoolHandover(PoolSpec(path))


def _samples(m: AppMetrics) -> dict[str, float]:
    out = {}
    for fam in m.registry.collect():
        for s in fam.samples:
            key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            out[key] = s.value
    return out


def test_request_record_splits_computed_and_saved_tokens():
    m = AppMetrics()
    m.request(RequestRecord("alpha", "a1", "agents", 0.05, 0.2, prompt_tokens=40, generated_tokens=5,
                            shared_tokens_expected=39, shared_tokens_loaded=39, kv_bytes_per_token=512))
    m.request(RequestRecord("alpha", "a2", "agents", 0.05, 0.2, prompt_tokens=40, generated_tokens=5,
                            shared_tokens_expected=39, shared_tokens_loaded=0, kv_bytes_per_token=512))
    m.prefill(PrefillRecord("base", "r1", computed_tokens=50, cached_tokens=32, seconds=0.1))
    s = _samples(m)
    assert s["prefillshare_prefill_tokens_saved_total{module=alpha,stage=decode}"] == 39
    assert s["prefillshare_prefill_tokens_computed_total{module=alpha,stage=decode}"] == 1 + 40
    assert s["prefillshare_prefill_tokens_computed_total{module=base,stage=prefill}"] == 50
    assert s["prefillshare_prefill_tokens_saved_total{module=base,stage=prefill}"] == 32
    assert s["prefillshare_kv_pool_hit_ratio{}"] == 0.5
    assert s["prefillshare_kv_bytes_moved_total{model=alpha}"] == 39 * 512
    assert s["prefillshare_ttft_seconds_count{agent=a1,model=alpha}"] == 1


def test_failed_request_counts_only_as_an_error():
    m = AppMetrics()
    m.request(RequestRecord("beta", "", "completions", None, 0.1, 10, 0, 9, 0, 512, ok=False))
    s = _samples(m)
    assert s["prefillshare_requests_total{model=beta,route=completions,status=error}"] == 1
    assert not any(k.startswith("prefillshare_e2e_seconds_count") for k in s)


def test_pool_counters_are_exported_per_scope(tmp_path):
    from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec

    pool = KVPool(PoolSpec(str(tmp_path / "pool"), capacity_bytes=1 << 20))
    pool.add("alpha", {"hits": 3, "misses": 1, "bytes_moved": 4096, "fallback:missing": 1})
    pool.flush()
    path = str(tmp_path / "pool")
    m = AppMetrics(_pool_mode(path), host="h0")
    m.nodes.update(("h0", path), [])  # an engine of this host sent its (older) view: the scrape reads the pool
    s = _samples(m)
    assert s[f"prefillshare_kv_pool_events_total{{event=hits,node=h0,pool={path},scope=alpha}}"] == 3
    assert s[f"prefillshare_kv_pool_events_total{{event=fallback:missing,node=h0,pool={path},scope=alpha}}"] == 1
    assert s[f"prefillshare_kv_pool_request_hit_ratio{{node=h0,pool={path}}}"] == 0.75
    assert s[f"prefillshare_kv_pool_capacity_bytes{{node=h0,pool={path}}}"] == 1 << 20


def test_pools_of_other_nodes_arrive_from_their_engines_labelled_by_node(tmp_path, monkeypatch):
    """Every node has its own pool and the Metrics replica (the head's, on KubeRay) may have none:
    each node's engines send theirs, and a node silent too long drops out."""
    from prefillshare.app.engine.pool.kv_pool import KVPool, PoolMissing, PoolSpec
    from prefillshare.app.engine.pool.metrics import PoolState, pool_families
    from prefillshare.deployments import metrics

    late = PoolState(str(tmp_path / "decode-node"))  # an engine's reader, before the pool exists
    with pytest.raises(PoolMissing):
        late.families()  # the engine skips this push and tries again at the next
    pools = {}
    for node, cap in (("prefill-node", 1 << 20), ("decode-node", 2 << 20)):
        pools[node] = KVPool(PoolSpec(str(tmp_path / node), capacity_bytes=cap))
        pools[node].add("base" if node == "prefill-node" else "alpha", {"hits": 1})
        pools[node].flush()
    m = AppMetrics(_pool_mode(str(tmp_path / "head")))  # no pool on this replica's node
    for node, pool in pools.items():
        m.nodes.update((node, "/dev/shm/p"), pool_families(pool))
    m.nodes.update(("decode-node", "/dev/shm/p"), late.families())  # its second engine, once the pool is there
    s = _samples(m)
    assert s["prefillshare_kv_pool_capacity_bytes{node=prefill-node,pool=/dev/shm/p}"] == 1 << 20
    assert s["prefillshare_kv_pool_capacity_bytes{node=decode-node,pool=/dev/shm/p}"] == 2 << 20
    assert s["prefillshare_kv_pool_events_total{event=hits,node=decode-node,pool=/dev/shm/p,scope=alpha}"] == 1
    assert "prefillshare_kv_pool_events_total{event=hits,node=prefill-node,pool=/dev/shm/p,scope=alpha}" not in s
    assert sum(v for k, v in s.items() if k.startswith("prefillshare_kv_pool_capacity_bytes")) == 3 << 20
    now = metrics.time.monotonic()
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now + metrics.ENGINE_STALE_S + 1)
    m.nodes.update(("decode-node", "/dev/shm/p"), pool_families(pools["decode-node"]))
    s = _samples(m)
    assert "prefillshare_kv_pool_capacity_bytes{node=prefill-node,pool=/dev/shm/p}" not in s  # gone silent
    assert s["prefillshare_kv_pool_capacity_bytes{node=decode-node,pool=/dev/shm/p}"] == 2 << 20


def test_missing_pool_never_fails_a_scrape(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    text = AppMetrics(_pool_mode(str(f))).render().decode()
    assert "# TYPE prefillshare_ttft_seconds histogram" in text
    assert "prefillshare_kv_pool_held_bytes" not in text


def test_the_overload_report_sums_the_pool_gauges_over_nodes_and_the_admission_bounds(monkeypatch):
    import httpx

    from bench.overload import app_gauges

    def gauge(name, value):
        return (name, "", "gauge", [(name, {}, value)])

    m = AppMetrics(_pool_mode("/nonexistent/prefillshare-pool"))
    m.nodes.update(("a", "/p"), [gauge("prefillshare_kv_pool_held_bytes", 100.0),
                                 gauge("prefillshare_kv_pool_pinned_blocks", 2.0)])
    m.nodes.update(("b", "/p"), [gauge("prefillshare_kv_pool_held_bytes", 50.0)])
    monkeypatch.setattr(httpx, "get", lambda url, timeout: type("R", (), {"text": m.render().decode()})())
    m.admission_limit.labels("r1").set(12)
    m.admission_limit.labels("r2").set(64)
    assert app_gauges("http://x") == {"held_bytes": 150.0, "pinned_blocks": 2.0, "admission_limit": 76.0}
    m.nodes.senders.clear()
    assert "held_bytes" not in app_gauges("http://x")  # no pool anywhere: nothing to plot, not zeros
