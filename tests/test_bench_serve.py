"""`prefillshare bench serve`: pure parts on made-up data, then one short real run.

The real run deploys the three systems (tiny random model, N=2, L=128, one load point of a
few seconds each) and checks that the outputs are well-formed and agree with each other:
no timing is asserted, only structure and accounting (tokens, ratios, files).
Run through scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from app.bench.client import AgentTiming, SessionResult, request_body
from app.bench.report import (
    PhaseCosts,
    compare,
    max_sustainable,
    parse_metrics,
    percentile,
    summarize,
    throughput_bound,
)
from app.bench.workload import ContextMaker, WorkloadSpec, make_sessions, poisson_arrivals

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = str(ROOT / "checkpoints" / "tokenizer")


def test_workload_is_seeded_sized_and_fans_out():
    maker = ContextMaker(TOKENIZER)
    spec = WorkloadSpec(context_tokens=300, fanout=3, output_tokens=5, rounds=2)
    a = make_sessions(spec, 3, seed=7, maker=maker)
    b = make_sessions(spec, 3, seed=7, maker=maker)
    assert a == b and a[0].context != a[1].context
    assert all(abs(maker.count(s.context) - 300) <= 16 for s in a)
    body = request_body(a[0], spec)
    assert [x["model"] for x in body["agents"]] == ["agent0", "agent1", "agent2"]
    assert body["rounds"] == 2 and all(x["max_tokens"] == 5 for x in body["agents"])
    arr = poisson_arrivals(2.0, 50.0, 1, 10_000)
    assert arr == sorted(arr) and 60 < len(arr) < 140  # ~100 expected; a wide band, seeded
    with pytest.raises(ValueError, match="fanouts"):
        WorkloadSpec(fanout=0)


def test_percentiles_bound_and_summary_accounting():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 95) is None
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    costs = {"a": PhaseCosts(1.0, 0.1, 0.5), "b": PhaseCosts(1.2, 1.2, 0.5)}
    # b: 4 x (1.2 + 0.5) = 6.8; a: 1.0 + 3 x 0.1 + 4 x 0.5 = 3.3
    assert throughput_bound(costs, 4, "b") == pytest.approx(6.8 / 3.3)
    spec = WorkloadSpec(256, 2, 4, 1)
    res = []
    for i in range(4):
        r = SessionResult(i, sent=10.0 * i, scheduled=10.0 * i, done=10.0 * i + 2.0, rounds_s=[2.0])
        r.agents = [AgentTiming(0, f"agent{k}", 10.0 * i, ttft_s=0.5, e2e_s=2.0, prompt_tokens=260,
                                completion_tokens=4) for k in range(2)]
        res.append(r)
    res[3].error = "HTTP 500"
    text = ('prefillshare_prefill_tokens_computed_total{stage="prefill",module="base"} 300\n'
            'prefillshare_prefill_tokens_saved_total{stage="prefill",module="base"} 100\n'
            'prefillshare_prefill_tokens_saved_total{stage="decode",module="agent0"} 500\n'
            'prefillshare_kv_pool_hit_tokens_total{model="agent0"} 500\n'
            'prefillshare_kv_pool_lookup_tokens_total{model="agent0"} 520\n')
    p = summarize("a", spec, "rate", 0.1, res, 0.0, 30.0, {}, parse_metrics(text), 1024.0, 10, 6.0)
    assert (p.ok, p.sent) == (3, 4) and p.errors == ["HTTP 500"]
    assert p.sessions_per_s == pytest.approx(0.1) and p.output_tok_per_s == pytest.approx(24 / 30)
    assert p.prefill_tokens_computed_per_session == pytest.approx(100) and p.cache_hit_ratio == pytest.approx(0.25)
    assert p.pool_hit_ratio == pytest.approx(500 / 520)
    assert p.decoder_kv_peak_bytes == 2 * 264 * 10  # two agents of one session overlap, sessions do not
    assert p.cpu_s_per_session == pytest.approx(2.0) and p.fanout_latency["p95"] == pytest.approx(2.0)
    assert max_sustainable([p], slo_s=5.0) is None  # a session failed: not sustainable
    q = summarize("b", spec, "rate", 0.1, res[:3], 0.0, 30.0, {}, {}, 0.0, 10, None)
    c = compare([p, q], costs, "b", 5.0)
    assert c.throughput_ratio == pytest.approx(1.0) and c.p95_ratios == [(0.1, pytest.approx(1.0))]


@pytest.mark.serve
@pytest.mark.engine
def test_short_run_of_three_systems_is_well_formed(tmp_path):
    from app.bench.models import SMALL
    from app.bench.serve_bench import ServeBenchConfig, run
    from app.bench.systems import Topology

    cfg = ServeBenchConfig(
        systems=("a", "b", "c"), fanouts=(2,), lengths=(128,), rounds=(2,), output_tokens=4, rates=(0.5,),
        duration_s=3.0, max_sessions=4, probes=1, warmup=1, shape=SMALL,
        topology=Topology(kv_cache_gib=0.125, prefill_replicas=1), out=str(tmp_path / "out"),
        model_dir=str(tmp_path / "models"), seed=random.Random().randint(0, 999))
    doc = run(cfg)
    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text())["points"] == doc["points"]
    for f in ("results.md", "p95_vs_load.png", "throughput_vs_n.png"):
        assert (out / f).stat().st_size > 0
    pts = {p["system"]: p for p in doc["points"]}
    assert set(pts) == {"a", "b", "c"}
    for s, p in pts.items():
        assert p["ok"] == p["sent"] >= 1, (s, p["errors"])
        assert p["fanout_latency"]["p50"] <= p["fanout_latency"]["p95"] <= p["fanout_latency"]["p99"]
        # every agent of every round generated exactly O tokens (EOS cannot win with the zeroed row)
        assert p["output_tok_per_s"] * p["wall_s"] == pytest.approx(p["ok"] * 2 * 2 * 4)
        assert p["cpu_s_per_session"] > 0 and p["prefill_tokens_computed_per_session"] > 0
    # the shared base computes each context once; per-model prefill computes it once per decoder
    assert pts["a"]["prefill_tokens_computed_per_session"] < pts["b"]["prefill_tokens_computed_per_session"]
    assert pts["a"]["pool_hit_ratio"] == pytest.approx(1.0) and pts["c"]["pool_hit_ratio"] is None
    assert pts["c"]["pool_peak_bytes"] == 0 and pts["a"]["pool_peak_bytes"] >= 0
    # round 2 extends round 1's context: every engine that saw round 1 finds it in its prefix cache
    assert all(p["cache_hit_ratio"] > 0 for p in pts.values())
    assert {c["baseline"] for c in doc["comparisons"]} == {"b", "c"}
    for c in doc["comparisons"]:
        assert c["throughput_bound"] > 0 and c["throughput_ratio"] > 0
    assert set(doc["phase_costs"]["128"]) == {"a", "b", "c"}
    md = (out / "results.md").read_text()
    assert "| a prefillshare | 2 | 128 | 2 |" in md and "bound" in md
