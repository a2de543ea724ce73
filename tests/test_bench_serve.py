"""`python -m bench serve`: pure parts on made-up data, every system's app config, one short real run.

The real run deploys the three LoRA systems (tiny random model and adapters, N=2, L=128, one
load point of a few seconds each; five engines in all) and checks that the outputs are
well-formed and agree with each other: no timing is asserted, only structure and accounting
(tokens, ratios, files). The full-decoder systems a, b, c are the same application with other
configs: their configs are built and planned here without engines, and the Serve tests run
that application. Run through scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from bench.client import AgentTiming, SessionResult, request_body
from bench.report import (
    PhaseCosts,
    compare,
    comparison_table,
    max_sustainable,
    parse_metrics,
    percentile,
    summarize,
    throughput_bound,
)
from bench.workload import ContextMaker, WorkloadSpec, make_sessions, poisson_arrivals

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
            'prefillshare_kv_pool_lookup_tokens_total{model="agent0"} 520\n'
            'vllm:time_to_first_token_seconds_sum{engine="0",model_name="base"} 1.5\n'
            'vllm:time_to_first_token_seconds_count{engine="0",model_name="base"} 4\n'
            'vllm:time_to_first_token_seconds_sum{engine="0",model_name="agent0"} 0.5\n'
            'vllm:time_to_first_token_seconds_count{engine="0",model_name="agent0"} 4\n'
            'vllm:request_queue_time_seconds_sum{engine="0",model_name="base"} 0.8\n'
            'vllm:request_queue_time_seconds_count{engine="0",model_name="base"} 8\n')
    p = summarize("a", spec, "rate", 0.1, res, 0.0, 30.0, {}, parse_metrics(text), 4096.0, 1024.0, 10, 6.0)
    assert (p.ok, p.sent) == (3, 4) and p.errors == ["HTTP 500"]
    assert p.sessions_per_s == pytest.approx(0.1) and p.output_tok_per_s == pytest.approx(24 / 30)
    assert p.prefill_tokens_computed_per_session == pytest.approx(100) and p.cache_hit_ratio == pytest.approx(0.25)
    assert p.pool_hit_ratio == pytest.approx(500 / 520)
    # the client's mean TTFT beside vLLM's own (every engine's requests): 2.0 s over 8 requests
    assert p.ttft_mean_s == pytest.approx(0.5) and p.engine_ttft_mean_s == pytest.approx(0.25)
    assert p.engine_means_s == pytest.approx({"request_queue_time": 0.1})  # histograms no engine fed: left out
    assert p.decoder_kv_peak_bytes == 2 * 264 * 10  # two agents of one session overlap, sessions do not
    # KV needed: pinned pool blocks + decoders; the pool's cached blocks are reported apart
    assert p.kv_held_peak_bytes == 1024 + 2 * 264 * 10 and p.pool_peak_bytes == 4096
    assert p.cpu_s_per_session == pytest.approx(2.0) and p.fanout_latency["p95"] == pytest.approx(2.0)
    assert max_sustainable([p], slo_s=5.0) is None  # a session failed: not sustainable
    q = summarize("b", spec, "rate", 0.1, res[:3], 0.0, 30.0, {}, {}, 0.0, 0.0, 10, None)
    assert q.engine_ttft_mean_s is None and q.engine_means_s is None  # no engine counted a request
    c = compare([p, q], costs, "b", 5.0)
    assert c.throughput_ratio == pytest.approx(1.0) and c.p95_ratios == [(0.1, 1.0, 1.0, 1.0)]
    assert c.throughput_spread is None and c.verdict == "one run: no spread"


def test_repeats_give_a_spread_and_a_reading():
    from dataclasses import replace

    from bench.report import spread_verdict

    spec = WorkloadSpec(256, 2, 4, 1)

    def point(system, rate, repeat, p95, cpu_s_per_session):
        r = SessionResult(0, sent=0.0, scheduled=0.0, done=p95, rounds_s=[p95])
        r.agents = [AgentTiming(0, "agent0", 0.0, ttft_s=0.1, e2e_s=p95, prompt_tokens=260, completion_tokens=4)]
        ok = int(rate * 10)
        p = summarize(system, spec, "concurrency", 1.0, [r] * ok, 0.0, 10.0, {}, {}, 0.0, 0.0, 10, cpu_s_per_session * ok)
        return replace(p, repeat=repeat)

    # a-lora twice as fast in every repeat; c-lora's p95 1.5x / 3x a-lora's; c-lora spends 4-6x the CPU
    pts = [point("a-lora", 0.4, 0, 1.0, 2.0), point("c-lora", 0.2, 0, 1.5, 8.0), point("a-lora", 0.6, 1, 1.0, 2.0),
           point("c-lora", 0.3, 1, 3.0, 12.0)]
    costs = {"a-lora": PhaseCosts(1.0, 0.1, 0.5), "c-lora": PhaseCosts(1.0, 1.0, 0.5)}
    c = compare(pts, costs, "c-lora", None, "a-lora")
    assert c.repeats == 2 and c.throughput_ratio == pytest.approx(2.0) and c.verdict == "better"
    assert c.p95_ratios == [(1.0, pytest.approx(2.25), pytest.approx(1.5), pytest.approx(3.0))]
    assert c.throughput_bound == pytest.approx((1.0 + 1.0 + 1.0) / (1.0 + 0.1 + 1.0))
    assert c.finished_sessions == {"a-lora": 10, "c-lora": 5}
    assert c.cpu_bound == pytest.approx(10.0 / 2.0)  # median CPU s per session, c-lora / a-lora
    # SLO 2 s: a-lora meets it in both repeats (0.4, 0.6 sessions/s), c-lora only in repeat 0 (0.2, then 0)
    slo = compare(pts, costs, "c-lora", 2.0, "a-lora").max_rate
    assert slo == {"a-lora": pytest.approx(0.5), "c-lora": pytest.approx(0.1)}
    assert "1: 2.25x [1.50-3.00] lower" in comparison_table([c])
    assert spread_verdict(0.8, 1.3) == "no measurable difference" and spread_verdict(0.5, 0.9) == "worse"


def test_report_remakes_tables_and_plots_of_a_saved_run(tmp_path):
    """``--report`` recomputes the comparisons from the saved points and costs (a damaged stored
    comparison is replaced) and draws every plot; a file that is not a run's JSON is refused by name."""
    from bench.serve_bench import rerender

    saved = json.loads((ROOT / "docs/results/bench_serve_lora.json").read_text())
    damaged = json.loads(json.dumps(saved))
    for c in damaged["comparisons"]:
        c["throughput_ratio"], c["p95_ratios"] = 0.0, []
    src = tmp_path / "run.json"
    src.write_text(json.dumps(damaged))
    doc = rerender(src, log=lambda *_: None)
    remade = json.loads(json.dumps(doc["comparisons"]))
    assert len(remade) == len(saved["comparisons"]) == 2
    for new, old in zip(remade, saved["comparisons"]):
        for k in ("label", "system", "baseline", "throughput_ratio", "throughput_spread", "p95_ratios", "throughput_bound"):
            assert new[k] == old[k], k
        assert new["cpu_bound"] > 1  # added since: CPU s per session of the baseline over a-lora's
    out = tmp_path / "run"  # beside the JSON, named after it
    for f in ("results.md", "p95_vs_load.png", "throughput_vs_n.png", "throughput_vs_load.png"):
        assert (out / f).stat().st_size > 0
    assert "| N=8 L=4096 R=1 | a-lora vs c-lora |" in (out / "results.md").read_text()
    # two runs drawn together: every point of both, each run's comparisons with its own phase costs
    grid = json.loads((ROOT / "docs/results/bench_serve_lora_grid.json").read_text())
    both = rerender([src, ROOT / "docs/results/bench_serve_lora_grid.json"], str(tmp_path / "both"), log=lambda *_: None)
    assert len(both["points"]) == len(saved["points"]) + len(grid["points"])
    assert [c["label"] for c in both["comparisons"]] == [c["label"] for c in saved["comparisons"] + grid["comparisons"]]
    assert "Runs drawn together" in (tmp_path / "both" / "results.md").read_text()
    with pytest.raises(SystemExit, match="give --out"):
        rerender([src, src])
    (tmp_path / "other.json").write_text('{"points": 1}')
    with pytest.raises(SystemExit, match="--report: .*other.json"):
        rerender(tmp_path / "other.json")


def test_the_qwen_shaped_random_model_is_chosen_by_name_and_single_fields_still_override_it():
    import argparse

    from bench.models import QWEN25_05B
    from bench.serve_bench import config_from_args, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    cfg = config_from_args(parser.parse_args(["--shape", "qwen2.5-0.5b"]))
    assert (cfg.shape.hidden, cfg.shape.layers, cfg.shape.heads, cfg.shape.kv_heads, cfg.shape.intermediate) == (
        896, 24, 14, 2, 4864) and cfg.shape == QWEN25_05B
    assert 400e6 < QWEN25_05B.params(151_936) < 520e6  # with Qwen's own vocabulary: ~0.5B, the model it copies
    assert config_from_args(parser.parse_args(["--shape", "qwen2.5-0.5b", "--layers", "2"])).shape.layers == 2


def test_every_system_is_a_valid_app_config(tmp_path):
    """The app systems' configs load and plan (adapters checked, per-adapter KV where it belongs); no engine starts."""
    from bench.models import SMALL, random_models
    from bench.stock_vllm import STOCK_SYSTEMS
    from bench.systems import SYSTEMS, Topology, app_config
    from prefillshare.app.config import load_config
    from prefillshare.app.plan import plan_app
    from prefillshare.deployments.application import build

    mset = random_models(tmp_path / "m", 2, SMALL, TOKENIZER, "float32", lora_rank=8)
    topo = Topology(kv_cache_gib=0.125, prefill_replicas=1, lora_rank=8, colocated_replicas=1)
    plans = {}
    for system in (s for s in SYSTEMS if s not in STOCK_SYSTEMS):  # the stock vLLM servers are no app
        cfg = load_config(app_config(system, mset, 2, topo, TOKENIZER, "/dev/shm/unused"))
        plans[system] = plan_app(cfg)
        assert [d.name for d in plans[system].decoders] == ["agent0", "agent1"]
        build(cfg)  # binds the deployments; nothing starts without serve.run
    assert all(d.prefill_module == "base" and d.adapter == d.name and d.prefill_adapter is None
               for d in plans["a-lora"].decoders)
    assert all(d.prefill_module == "own" and d.prefill_adapter == d.name for d in plans["b-lora"].decoders)
    assert all(d.prefill_module is None and d.group == "lora-group" for d in plans["c-lora"].decoders)
    assert all(d.adapter is None for s in ("a", "b", "c") for d in plans[s].decoders)
    assert all(d.in_engine and d.prefill_module == "base" and d.adapter == d.name and d.group is None
               for d in plans["i-lora"].decoders)
    # i-lora is one engine given every core (Ray turns num_cpus into its OpenMP threads), or replicas sharing them
    from bench.systems import machine_cpus
    for replicas in (1, 2):
        place = app_config("i-lora", mset, 2, replace(topo, in_engine_replicas=replicas), TOKENIZER,
                           "/dev/shm/unused")["prefill_modules"][0]["placement"]
        assert (place["num_replicas"], place["num_cpus"]) == (replicas, machine_cpus() / replicas)
        assert replace(topo, in_engine_replicas=replicas).engines("i-lora", 4) == replicas


@pytest.mark.serve
@pytest.mark.engine
def test_short_run_of_the_lora_systems_is_well_formed(tmp_path):
    """a-lora (the app: shared base, one decode group) against c-lora (multi-LoRA engines), driven
    by the project's client. b-lora is left to test_every_system_is_a_valid_app_config and, for its
    per-adapter KV, tests/keyless_app/test_lora_groups.py: one app start less in CI."""
    from bench.models import SMALL
    from bench.serve_bench import ServeBenchConfig, run
    from bench.systems import Topology

    systems = ("a-lora", "c-lora")
    cfg = ServeBenchConfig(
        systems=systems, fanouts=(2,), lengths=(128,), rounds=(2,), output_tokens=4, rates=(0.5,),
        duration_s=2.0, max_sessions=3, probes=1, warmup=0, shape=SMALL,
        topology=Topology(kv_cache_gib=0.125, prefill_replicas=1, lora_rank=8, colocated_replicas=1),
        out=str(tmp_path / "out"), model_dir=str(tmp_path / "models"), seed=random.Random().randint(0, 999))
    doc = run(cfg)
    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text())["points"] == doc["points"]
    for f in ("results.md", "p95_vs_load.png", "throughput_vs_n.png", "throughput_vs_load.png"):
        assert (out / f).stat().st_size > 0
    pts = {p["system"]: p for p in doc["points"]}
    assert set(pts) == set(systems)
    for s, p in pts.items():
        assert p["ok"] == p["sent"] >= 1, (s, p["errors"])
        assert p["fanout_latency"]["p50"] <= p["fanout_latency"]["p95"] <= p["fanout_latency"]["p99"]
        # every agent of every round generated exactly O tokens (EOS cannot win with the zeroed row)
        assert p["output_tok_per_s"] * p["wall_s"] == pytest.approx(p["ok"] * 2 * 2 * 4)
        assert p["cpu_s_per_session"] > 0 and p["prefill_tokens_computed_per_session"] > 0
    # the shared base computes each context once; a multi-LoRA engine computes it once per adapter
    assert pts["a-lora"]["prefill_tokens_computed_per_session"] < pts["c-lora"]["prefill_tokens_computed_per_session"]
    # every adapter's request found the base's KV in the pool
    assert pts["a-lora"]["pool_hit_ratio"] == pytest.approx(1.0)
    assert pts["c-lora"]["pool_hit_ratio"] is None and pts["c-lora"]["pool_peak_bytes"] == 0
    # round 2 extends round 1's context: every engine that saw round 1 finds it in its prefix cache
    assert all(p["cache_hit_ratio"] > 0 for p in pts.values())
    assert {(c["system"], c["baseline"]) for c in doc["comparisons"]} == {("a-lora", "c-lora")}
    for c in doc["comparisons"]:
        assert c["throughput_bound"] > 0 and c["throughput_ratio"] > 0
    assert set(doc["phase_costs"]["128"]) == set(systems)
    # the random models stream text (no token held back by the detokenizer until the end), so the
    # probes see a first token before the last and the bound gets its decode term
    assert all(c["decode_s"] > 0 for c in doc["phase_costs"]["128"].values()), doc["phase_costs"]
    md = (out / "results.md").read_text()
    assert "| a-lora prefillshare-lora | 2 | 128 | 2 |" in md and "bound" in md


# --- vLLM's benchmark client as the driver; stock vLLM servers as systems ---
def test_vllm_client_sends_n_requests_per_shared_prefix_round_robin_without_ignore_eos():
    """The arguments parse with vLLM's own parser; the dataset it samples from them keeps file order:
    requests k*N..k*N+N-1 share prefix k (L tokens), each with its own suffix, one per decoder."""
    from vllm.benchmarks.datasets.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from bench.vllm_client import SUFFIX_TOKENS, client_argv
    from prefillshare.app.training.tokenizer import load_tokenizer

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    spec = WorkloadSpec(64, 3, 4, 1)
    args = parser.parse_args(client_argv("http://x", spec, "concurrency", 2, 4, TOKENIZER, ["agent0", "agent1", "agent2"], 7))
    assert (args.dataset_name, args.disable_shuffle, args.lora_assignment) == ("prefix_repetition", True, "round-robin")
    assert args.lora_modules == ["agent0", "agent1", "agent2"] and args.num_prompts == 12 and args.max_concurrency == 6
    assert not args.ignore_eos  # the app refuses ignore_eos; prefix_repetition does not turn it on by itself
    tok = load_tokenizer(TOKENIZER)
    reqs = get_samples(args, tok)
    ids = [tok(r.prompt, add_special_tokens=False)["input_ids"] for r in reqs]
    assert len(reqs) == 12 and all(r.expected_output_len == 4 for r in reqs)
    # random token ids re-encode to about as many tokens
    assert all(abs(r.prompt_len - (64 + SUFFIX_TOKENS)) <= 4 for r in reqs), [r.prompt_len for r in reqs]
    for k in range(4):
        group = [r.prompt for r in reqs[3 * k: 3 * k + 3]]
        assert len(set(group)) == 3  # every agent's own suffix
        head = [i[:48] for i in ids[3 * k: 3 * k + 3]]  # the shared prefix, allowing for re-encoding at its end
        assert head[0] == head[1] == head[2]
    assert ids[0][:48] != ids[3][:48]  # the next session is a fresh context
    rate = parser.parse_args(client_argv("http://x", spec, "rate", 0.5, 4, TOKENIZER, ["agent0", "agent1", "agent2"], 7))
    assert rate.request_rate == 1.5 and rate.max_concurrency is None  # 0.5 sessions/s of 3 requests


def test_vllm_client_results_regroup_into_sessions():
    from bench.report import summarize
    from bench.vllm_client import sessions_of

    result = {"start_times": [10.0, 10.1, 20.0, 20.0], "ttfts": [0.5, 0.4, 0.3, 0.0], "latencies": [2.0, 3.0, 1.0, 0.0],
              "output_lens": [4, 4, 4, 0], "input_lens": [80, 80, 80, 80], "errors": ["", "", "", "HTTP 500"],
              "duration": 11.0}
    sessions, t0, t_end = sessions_of(result, 2, ["agent0", "agent1"])
    assert [s.ok for s in sessions] == [True, False]
    assert sessions[0].rounds_s == [pytest.approx(3.1)] and [a.agent for a in sessions[0].agents] == ["agent0", "agent1"]
    assert sessions[1].agents[1].error == "HTTP 500" and (t0, t_end) == (10.0, pytest.approx(21.0))
    p = summarize("a-lora", WorkloadSpec(64, 2, 4, 1), "concurrency", 1.0, sessions, t0, t_end, {}, {}, 0.0, 0.0, 10, 4.0)
    assert (p.ok, p.sent, p.errors) == (1, 2, ["HTTP 500"]) and p.output_tok_per_s == pytest.approx(8 / 11)


def test_a_run_with_the_stock_servers_renders_tables_plots_and_their_comparisons(tmp_path):
    from dataclasses import replace

    from bench.report import compare_all
    from bench.serve_bench import render_markdown, write_outputs

    spec = WorkloadSpec(64, 2, 4, 1)
    r = SessionResult(0, sent=0.0, scheduled=0.0, done=1.0, rounds_s=[1.0])
    r.agents = [AgentTiming(0, f"agent{k}", 0.0, ttft_s=0.1, e2e_s=1.0, prompt_tokens=80, completion_tokens=4)
                for k in range(2)]
    pts = [replace(summarize(s, spec, "concurrency", 1.0, [r] * k, 0.0, 10.0, {}, {}, 0.0, 0.0, 10, 2.0 * k), loadavg=1.0)
           for s, k in (("a-lora", 6), ("v-lora", 2), ("v-one", 8))]
    comps = compare_all(pts, {}, None)
    assert [(c.system, c.baseline, c.throughput_ratio) for c in comps] == [
        ("a-lora", "v-lora", pytest.approx(3.0)), ("a-lora", "v-one", pytest.approx(0.75))]
    doc = {"config": {"repeats": 1, "driver": "vllm"}, "machine": {"cpus": 2, "memory_gib": 24, "loadavg_at_end": [1.0],
           "time_utc": "x"}, "models": {"description": "m"}, "skipped": [],
           "topology": {"kv_cache_gib": 0.1, "block_size": 32, "threads_bind": "nobind", "max_model_len": 256,
                        "prefill_replicas": 1, "lora_rank": 8, "colocated_replicas": 1}}
    write_outputs(doc, pts, comps, {}, str(tmp_path), log=lambda *_: None)
    md = (tmp_path / "results.md").read_text()
    assert md == render_markdown(doc, pts, comps, {}) and "| v-one vllm-one-model | 2 | 64 | 1 |" in md
    assert "| N=2 L=64 R=1 | a-lora vs v-one |" in md and "vLLM's benchmark client" in md
    assert all((tmp_path / f).stat().st_size > 0 for f in ("p95_vs_load.png", "throughput_vs_n.png"))


def test_stock_vllm_servers_parse_with_vllms_own_parser(tmp_path):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from bench.serve_bench import ServeBenchConfig
    from bench.stock_vllm import as_prefillshare_counters, server_argv
    from bench.systems import Topology

    topo = Topology(kv_cache_gib=0.125, lora_rank=8, max_model_len=512, dtype="float32")
    parser = make_arg_parser(FlexibleArgumentParser())
    lora = parser.parse_args(server_argv("v-lora", "/m/base", ("/m/a0", "/m/a1"), 2, topo, TOKENIZER, 1234)[3:])
    assert lora.enable_lora and lora.max_loras == 2 and lora.enable_prefix_caching and lora.port == 1234
    assert [(m.name, m.path) for m in lora.lora_modules] == [("agent0", "/m/a0"), ("agent1", "/m/a1")]
    assert lora.kv_cache_memory_bytes == 2 * (1 << 30) // 8  # the app's LoRA group engine: N x the KV space
    one = parser.parse_args(server_argv("v-one", "/m/base", (), 2, topo, TOKENIZER, 1234)[3:])
    assert one.served_model_name == ["agent0", "agent1"] and not one.enable_lora
    assert one.shutdown_timeout == lora.shutdown_timeout > 0  # a stop lets the worker unlink its shared memory
    text = 'vllm:prefix_cache_queries_total{engine="0"} 300\nvllm:prefix_cache_hits_total{engine="0"} 100\n'
    m = as_prefillshare_counters(parse_metrics(text))
    assert m[("prefillshare_prefill_tokens_computed_total", (("stage", "prefill"),))] == 200  # the prefill stage
    with pytest.raises(ValueError, match="--driver vllm"):
        ServeBenchConfig(systems=("a-lora", "v-lora"))
    with pytest.raises(ValueError, match="one round"):
        ServeBenchConfig(systems=("a-lora",), driver="vllm", rounds=(2,))


@pytest.mark.serve
@pytest.mark.engine
def test_short_run_driven_by_vllms_client_against_the_app_and_a_stock_server(tmp_path):
    """a-lora (the app) and v-lora (stock vLLM, multi-LoRA with prefix caching), both driven by
    vLLM's client: every request answered, the ratio made of the measured throughputs."""
    from bench.models import SMALL
    from bench.serve_bench import ServeBenchConfig, run
    from bench.systems import Topology

    systems = ("a-lora", "v-lora")
    cfg = ServeBenchConfig(
        systems=systems, driver="vllm", fanouts=(2,), lengths=(128,), rounds=(1,), output_tokens=4, rates=(),
        concurrency=(1,), max_sessions=3, warmup=1, shape=SMALL,
        topology=Topology(kv_cache_gib=0.125, prefill_replicas=1, lora_rank=8, colocated_replicas=1),
        out=str(tmp_path / "out"), model_dir=str(tmp_path / "models"), seed=random.Random().randint(0, 999))
    lines: list[str] = []
    doc = run(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    # the warm-up goes through vLLM's client too (a stock server has no agent route)
    assert not [ln for ln in lines if "warm-up session failed" in ln], lines
    pts = {p["system"]: p for p in doc["points"]}
    assert set(pts) == set(systems)
    for s, p in pts.items():
        assert p["ok"] == p["sent"] == 3, (s, p["errors"])
        assert p["output_tok_per_s"] * p["wall_s"] == pytest.approx(3 * 2 * 4)  # O tokens each, no EOS
    # the shared base computes each prefix once; the stock server once per adapter
    assert pts["a-lora"]["prefill_tokens_computed_per_session"] < pts["v-lora"]["prefill_tokens_computed_per_session"]
    [c] = doc["comparisons"]
    assert (c["system"], c["baseline"]) == ("a-lora", "v-lora") and c["throughput_bound"] is None
    assert c["throughput_ratio"] == pytest.approx(pts["a-lora"]["sessions_per_s"] / pts["v-lora"]["sessions_per_s"])
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| a-lora vs v-lora |" in md and "vLLM's benchmark client" in md


# --- agents with their own system prompts and tools (--driver chat) ---
def _chat_prompts(tmp_path, layout: str, n: int = 2):
    """The app's prompt ids of one session's N agent requests, as a framework sends them, rendered by
    the bench's chat adapters of ``layout`` through the app's Prompter (what the Router calls)."""
    from bench.client import chat_bodies
    from bench.models import SMALL, random_models
    from bench.workload import agent_profiles
    from prefillshare.app.rendering import Renderer
    from prefillshare.deployments.ingress.schemas import ChatBody
    from prefillshare.deployments.ingress.tools import tools_line
    from prefillshare.deployments.prompts import Prompter

    mset = random_models(tmp_path / "m", n, SMALL, TOKENIZER, "float32", lora_rank=8)
    dirs = {"shared_first": mset.shared_first, "system_first": mset.system_first}[layout]
    prompter = Prompter(TOKENIZER, {f"agent{i}": Renderer.for_decoder(d) for i, d in enumerate(dirs)})
    maker = ContextMaker(TOKENIZER)
    spec = WorkloadSpec(300, n, 4, 1)
    session = make_sessions(spec, 1, 3, maker)[0]
    bodies = [ChatBody(**b) for b in chat_bodies(session, spec, agent_profiles([f"agent{i}" for i in range(n)], 0, maker))]
    ids = [prompter.chat_prompt([(m.role, m.content) for m in b.messages], model=b.model, tools_line=tools_line(b.tools))
           for b in bodies]
    return mset, session, bodies, ids


def test_agent_profiles_are_seeded_distinct_and_of_realistic_length():
    from bench.client import chat_bodies
    from bench.workload import agent_profiles

    maker = ContextMaker(TOKENIZER)
    names = ["agent0", "agent1", "agent2", "agent3"]
    a, b = agent_profiles(names, 0, maker), agent_profiles(names, 0, maker)
    assert a == b and len({p.system for p in a}) == 4 and [p.model for p in a] == names
    assert all(200 <= maker.count(p.system) <= 500 for p in a), [maker.count(p.system) for p in a]
    assert len({maker.count(p.system) for p in a}) > 1  # each agent's own length
    assert all(len(p.tools) == 2 and len({t["function"]["name"] for t in p.tools}) == 2 for p in a)
    t = a[0].tools[0]["function"]
    assert t["description"] and set(t["parameters"]["required"]) == set(t["parameters"]["properties"]) != set()
    assert agent_profiles(names, 1, maker)[0].system != a[0].system
    assert all(p.tools == () for p in agent_profiles(names, 0, maker, (20, 30), tools=0))
    spec = WorkloadSpec(64, 3, 5, 1)
    session = make_sessions(spec, 1, 0, maker)[0]
    bodies = chat_bodies(session, spec, a)
    assert [x["model"] for x in bodies] == names[:3]  # N agents of the 4 profiles
    assert all(x["messages"] == [{"role": "system", "content": p.system}, {"role": "user", "content": session.context}]
               for x, p in zip(bodies, a))
    assert all(x["stream"] and x["max_tokens"] == 5 and "tool_choice" not in x and x["tools"] for x in bodies)
    with pytest.raises(ValueError, match="system-tokens"):
        agent_profiles(names, 0, maker, (300, 200))


def test_shared_first_agents_share_the_context_and_stock_vllm_renders_the_system_first_prompt(tmp_path):
    """Through the app's own Prompter: shared-first agents' prompts share the whole context, system-first
    ones part at their first own token; the stock servers' template (vLLM hands it ``tools``) makes the
    system-first prompt token for token, so the three systems are asked the same thing."""
    from transformers import AutoTokenizer

    from bench.models import BENCH_CHAT_TEMPLATE
    from prefillshare.app.models.manifest import read_manifest
    from prefillshare.app.sharing import common_prefix

    mset, session, bodies, sf = _chat_prompts(tmp_path, "shared_first")
    _, _, _, sys_first = _chat_prompts(tmp_path, "system_first")
    ctx = ContextMaker(TOKENIZER).count(session.context)
    assert len(common_prefix(sf)) >= ctx and len(common_prefix(sys_first)) < 16
    manifests = [read_manifest(d) for d in mset.shared_first + mset.system_first]
    assert {m.tool_call_format for m in manifests} == {"json"} and {m.prompt.format for m in manifests} == {"chat_template"}
    assert [m.prompt.layout for m in manifests] == ["shared_first"] * 2 + ["system_first"] * 2
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    for b, ids in zip(bodies, sys_first):
        text = tok.apply_chat_template([m.model_dump(include={"role", "content"}) for m in b.messages],
                                       tools=[t.model_dump() for t in b.tools], chat_template=BENCH_CHAT_TEMPLATE,
                                       add_generation_prompt=True, tokenize=False)
        assert tok(text, add_special_tokens=False)["input_ids"] == ids
    assert Path(mset.chat_template).read_text() == BENCH_CHAT_TEMPLATE


def test_chat_session_reads_streams_and_the_agents_table(tmp_path):
    """run_chat_session against a fake server: N requests, TTFT at the first content or tool call,
    usage read; a failed agent fails its session. The agents table sets each system beside a-sf-lora."""
    import asyncio

    import httpx

    from bench.client import run_chat_session
    from bench.plots import agents_bars
    from bench.report import agents_table
    from bench.workload import AgentProfile

    def chunk(delta=None, usage=None):
        return "data: " + json.dumps({"choices": [{"delta": delta}] if delta is not None else [], "usage": usage})

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["model"] == "bad":
            return httpx.Response(400, text="tools: no")
        first = {"tool_calls": [{"index": 0}]} if body.get("tools") else {"content": "x"}
        lines = [chunk({"role": "assistant"}), chunk(first), chunk({"content": "y"}),
                 chunk(usage={"prompt_tokens": 90, "completion_tokens": 2}), "data: [DONE]"]
        return httpx.Response(200, text="\n\n".join(lines) + "\n\n")

    spec = WorkloadSpec(64, 2, 2, 1)
    session = make_sessions(spec, 1, 0, ContextMaker(TOKENIZER))[0]
    tool = ({"type": "function", "function": {"name": "f"}},)
    profiles = [AgentProfile("agent0", "s0", tool), AgentProfile("agent1", "s1", ())]

    async def go(ps):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as c:
            return await run_chat_session(c, "http://x", session, spec, 0.0, 30.0, profiles=ps)

    ok = asyncio.run(go(profiles))
    assert ok.ok and [a.agent for a in ok.agents] == ["agent0", "agent1"] and ok.rounds_s
    assert all(0 <= a.ttft_s <= a.e2e_s and (a.prompt_tokens, a.completion_tokens) == (90, 2) for a in ok.agents)
    bad = asyncio.run(go([profiles[0], AgentProfile("bad", "s", ())]))
    assert not bad.ok and bad.agents[1].error == "HTTP 400: tools: no" and bad.agents[0].error is None
    metrics = {"a-sf-lora": "prefill\"} 300", "a-sys-lora": "prefill\"} 900", "v-lora": "prefill\"} 960"}
    pts = [summarize(s, spec, "concurrency", 1.0, [ok] * 3, 0.0, 3.0 * k, {},
                     parse_metrics('prefillshare_prefill_tokens_computed_total{stage="decode"} 6\n'
                                   'prefillshare_fallbacks_total{reason="prefill_overloaded"} 2\n'
                                   'prefillshare_prefill_tokens_computed_total{stage="' + m), 0.0, 0.0, 10, 1.0)
           for k, (s, m) in enumerate(metrics.items(), start=1)]
    assert pts[0].base_prompt_tokens_per_session == 100 and pts[0].prompt_tokens_per_request == 90
    assert pts[0].request_latency["p95"] is not None and pts[0].fallbacks == {"prefill_overloaded": 2}
    table = agents_table(pts)
    assert "| a-sf-lora prefillshare-lora-shared-first | 2 | 64 | c=1 | 3/3 | 90 | 100 | 1.11x | 1.00x |" in table
    assert "| a-sys-lora prefillshare-lora-system-first | 2 | 64 | c=1 | 3/3 | 90 | 300 | 3.33x | 3.00x |" in table
    assert table.splitlines()[-1].endswith("| 0.333 | 0.667 | 0.33x |")  # v-lora: a third of the throughput
    assert agents_bars(pts, tmp_path / "agents.png").stat().st_size > 0


def test_chat_driver_config_and_stock_servers_with_the_chat_template(tmp_path):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from bench.serve_bench import ServeBenchConfig, _max_model_len, render_markdown
    from bench.stock_vllm import server_argv
    from bench.systems import Topology

    cfg = ServeBenchConfig(systems=("a-sf-lora", "a-sys-lora", "v-lora"), driver="chat", fanouts=(4,),
                           lengths=(2048,), concurrency=(1,), rates=())
    assert _max_model_len(cfg, 8192) >= 2048 + 500 + 4 * 32  # context, the longest system prompt, tools, answers
    for bad, match in (({"systems": ("a-lora",)}, "a-sf-lora"), ({"rounds": (2,)}, "one round"),
                       ({"system_tokens": (50, 10)}, "system-tokens"), ({"system_tokens": (200,)}, "system-tokens")):
        with pytest.raises(ValueError, match=match):
            ServeBenchConfig(**{"systems": ("a-sf-lora",), "driver": "chat", **bad})
    parser = make_arg_parser(FlexibleArgumentParser())
    topo = Topology(kv_cache_gib=0.125, lora_rank=8, max_model_len=1024, dtype="float32")
    args = parser.parse_args(server_argv("v-lora", "/m/base", ("/m/a0",), 1, topo, TOKENIZER, 1, "/m/t.jinja")[3:])
    assert args.chat_template == "/m/t.jinja" and args.enable_auto_tool_choice and args.tool_call_parser == "pythonic"
    doc = {"config": {"repeats": 1, "driver": "chat", "system_tokens": [200, 500], "agent_tools": 2},
           "machine": {"cpus": 2, "memory_gib": 24, "loadavg_at_end": [1.0], "time_utc": "x"},
           "models": {"description": "m"}, "skipped": [],
           "topology": {"kv_cache_gib": 0.1, "block_size": 32, "threads_bind": "nobind", "max_model_len": 256,
                        "prefill_replicas": 1, "lora_rank": 8, "colocated_replicas": 1}}
    md = render_markdown(doc, [], [], {})
    assert "## Agents with their own system prompts" in md and "200-500 tokens and 2 tools" in md


def test_compare_runs_pairs_rounds_and_gives_each_points_ratio_and_spread(tmp_path):
    from bench.compare_runs import compare, render

    def run(name, sps, ttft):
        point = {"system": "a-lora", "fanout": 4, "context_tokens": 2048, "rounds": 1, "load": 1.0,
                 "sessions_per_s": sps, "fanout_latency": {"p50": 1.0, "p95": 2.0}, "ttft": {"p50": ttft},
                 "cpu_s_per_session": None}
        other = {**point, "system": "a"}  # only in this run: not compared
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"points": [point] + ([other] if name == "b1" else [])}))
        return str(path)

    rows = compare([run("b1", 1.0, 0.4), run("b2", 2.0, 0.4)], [run("a1", 1.2, 0.2), run("a2", 2.0, 0.4)])
    assert [r["point"] for r in rows] == [("a-lora", 4, 2048, 1, 1.0)]
    ratios, olds, news = rows[0]["values"]["sessions/s"]
    assert ratios == pytest.approx([1.2, 1.0]) and olds == [1.0, 2.0] and news == [1.2, 2.0]
    table = render(rows, ("old", "new"))
    assert "1.10x (1.00-1.20)" in table and "0.75x (0.50-1.00)" in table  # TTFT p50: 0.5 and 1.0
    assert table.splitlines()[2].endswith("| - |")  # no CPU figures: no ratio
    with pytest.raises(ValueError, match="same number of runs"):
        compare([run("b1", 1.0, 0.4)], [])
