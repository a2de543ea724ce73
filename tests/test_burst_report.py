"""bench/burst.py's report on a synthetic run: the scale events it reads from the replica and
target samples, the prefix-cache ratio around the prefill module's upscale, and its promises."""
from __future__ import annotations

from bench.burst import render, scale_events, schedule, summarize


def _rows(up_at=100, ready_at=150, down_at=330, hits_after=0.6):
    rows = []
    for t in range(0, 400, 2):
        target = 2 if up_at <= t < down_at else 1
        running = 2 if ready_at <= t < down_at + 4 else 1
        q = float(t * 100)
        h = q * 0.6 if t < ready_at else 150 * 100 * 0.6 + (q - 150 * 100) * hits_after
        rows.append({"t_s": t, "replicas": {"Prefill-base": running, "Decode-a": 1},
                     "targets": {"Prefill-base": target, "Decode-a": 1}, "prefix_hits": h, "prefix_queries": q})
    return rows


def _raw(rows, samples=None):
    samples = samples or [{"kind": "completion", "stream": True, "sent_s": t, "latency_s": 1.0, "outcome": "ok"}
                          for t in range(0, 390)]
    return {"spec": {"base_per_s": 1, "burst": 4, "before_s": 90.0, "burst_s": 180.0, "after_s": 120.0, "mix": {},
                     "seed": 0}, "samples": samples, "fleet": rows}


def test_the_rate_follows_the_three_phases():
    rate = schedule(2.0, 4.0, 90.0, 180.0)
    assert (rate(0), rate(90), rate(269.9), rate(270)) == (2.0, 8.0, 8.0, 2.0)


def test_a_burst_that_scales_up_and_back_keeps_its_promises():
    [e] = scale_events(_rows(), 90.0, 270.0, {"Prefill-base": 60.0})
    assert (e["deployment"], e["from"], e["to"], e["up_took_s"], e["down_took_s"]) == ("Prefill-base", 1, 2, 50, 64)
    rep = summarize(_raw(_rows()), {"Prefill-base": 60.0})
    assert rep["promises"] == {"scaled_up": True, "scaled_down": True, "nothing_lost": True,
                               "errors_within_budget": True, "prefix_cache_kept": True}
    assert "Prefill-base | 1 -> 2" in render(_raw(_rows()), rep)


def test_a_lost_stream_a_slow_shrink_and_a_cache_lost_on_growth_are_each_a_broken_promise():
    samples = [{"kind": "completion", "stream": True, "sent_s": t, "latency_s": 1.0, "outcome": "ok"}
               for t in range(0, 390)]
    samples[200]["outcome"] = "lost stream cut"
    rep = summarize(_raw(_rows(down_at=390, hits_after=0.1), samples), {"Prefill-base": 60.0})
    assert rep["promises"]["nothing_lost"] is False
    assert rep["promises"]["scaled_down"] is False  # still at 2 when the run ended
    assert rep["promises"]["prefix_cache_kept"] is False
