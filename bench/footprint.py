"""Engine footprint on the CPU: the worker in its own process (vLLM's default) vs inside EngineCore.

vLLM runs an ``AsyncLLM`` on the CPU as three processes (caller, EngineCore, worker) unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is in the engine's environment, which puts the worker inside
EngineCore. This measures both with the app's own engines (prefillshare.app.engine.async_engine.Engine): a
producer on the base and a consumer decoder loading its KV through the PrefillShare connector,
each mode in a fresh process, modes alternating. Per run: start-up seconds, resident memory of the
engine processes (RSS and PSS), CPU seconds per session (one context of ``L`` tokens, ``N`` agent
prompts prefilled on the base, each decoded for ``O`` tokens on the decoder) and the tokens,
which must be equal across modes.

    python -m bench footprint --runs 2 --out runs/bench/footprint.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.engine_bench import process_tree_cpu_seconds

PROJECT = Path(__file__).resolve().parents[1]
MODES = {"mp": {}, "uni": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def _memory() -> dict:
    import psutil

    rss = pss = 0
    procs = psutil.Process().children(recursive=True) + [psutil.Process()]
    for p in procs:
        try:
            m = p.memory_full_info()
            rss += m.rss
            pss += getattr(m, "pss", m.rss)
        except psutil.Error:
            pass
    return {"processes": len(procs), "rss_gib": rss / 2**30, "pss_gib": pss / 2**30}


async def _child(args) -> dict:
    from prefillshare.app.engine.async_engine import Engine, EngineConfig, Sampling
    from prefillshare.app.engine.pool.handover import connector_config
    from prefillshare.app.engine.pool.kv_pool import PoolSpec
    from prefillshare.app.models.identity import prefill_module_id

    base = str(PROJECT / "checkpoints" / "base")
    dec = str(PROJECT / "checkpoints" / "decoders" / "lookup")
    pool_dir = f"/dev/shm/ps-footprint-{os.getpid()}"
    pool = PoolSpec(path=pool_dir, capacity_bytes=256 << 20)
    mid = prefill_module_id(base)
    common = dict(max_model_len=1024, block_size=32, kv_cache_memory_bytes=256 << 20, max_num_seqs=16,
                  extra_env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", **MODES[args.child]})
    mem0 = _memory()
    t0 = time.perf_counter()
    prod = await Engine.start(EngineConfig(model=base, kv_transfer_config=connector_config("producer", mid, pool),
                                           **common))
    t1 = time.perf_counter()
    cons = await Engine.start(EngineConfig(model=dec, kv_transfer_config=connector_config("consumer", mid, pool),
                                           **common))
    t2 = time.perf_counter()
    rng = random.Random(args.seed)
    vocab = 600
    tokens, cached = [], 0
    try:
        sessions = []
        for _ in range(args.sessions + 1):
            ctx = [rng.randrange(3, vocab) for _ in range(args.length)]
            sessions.append([ctx + [rng.randrange(3, vocab) for _ in range(8)] for _ in range(args.agents)])
        cpu0, w0 = None, None
        for s, prompts in enumerate(sessions):  # session 0 warms both engines up, unmeasured
            if s == 1:
                cpu0, w0 = process_tree_cpu_seconds(include_self=True), time.perf_counter()
            await asyncio.gather(*[prod.prefill(p, f"p{s}-{i}", kv_transfer_params={"fanout": 1})
                                   for i, p in enumerate(prompts)])
            outs = await asyncio.gather(*[cons.complete(p, Sampling(max_tokens=args.output_tokens, ignore_eos=True),
                                                        f"d{s}-{i}") for i, p in enumerate(prompts)])
            if s:
                tokens.append([o.token_ids for o in outs])
                cached += sum(o.num_cached_tokens for o in outs)
        cpu = process_tree_cpu_seconds(include_self=True) - cpu0
        wall = time.perf_counter() - w0
        mem = _memory()
    finally:
        prod.shutdown()
        cons.shutdown()
        shutil.rmtree(pool_dir, ignore_errors=True)
    return {"mode": args.child, "startup_s": [t1 - t0, t2 - t1], "processes": mem["processes"] - mem0["processes"],
            "rss_gib_per_engine": (mem["rss_gib"] - mem0["rss_gib"]) / 2,
            "pss_gib_per_engine": (mem["pss_gib"] - mem0["pss_gib"]) / 2,
            "cpu_s_per_session": cpu / args.sessions, "wall_s_per_session": wall / args.sessions,
            "cached_tokens": cached, "tokens": tokens}


def configure(p: argparse.ArgumentParser) -> None:
    """Arguments of `python -m bench footprint`."""
    p.add_argument("--runs", type=int, default=2, help="runs per mode, alternating")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--length", type=int, default=900)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/footprint.json")
    p.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(asyncio.run(_child(args))))
        return 0
    runs = []
    for r in range(args.runs):
        for mode in MODES:
            cmd = [sys.executable, "-m", "bench", "footprint", "--child", mode, "--sessions", str(args.sessions),
                   "--agents", str(args.agents), "--length", str(args.length),
                   "--output-tokens", str(args.output_tokens), "--seed", str(args.seed)]
            out = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            res["loadavg"] = os.getloadavg()[0]
            runs.append(res)
            print(f"run {r} {mode}: start {sum(res['startup_s']):.1f}s, {res['processes']} processes, "
                  f"RSS {res['rss_gib_per_engine']:.2f} GiB/engine, PSS {res['pss_gib_per_engine']:.2f}, "
                  f"CPU {res['cpu_s_per_session']:.2f} s/session, wall {res['wall_s_per_session']:.2f} s, "
                  f"load {res['loadavg']:.1f}", flush=True)
    equal = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    summary = {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        summary[mode] = {k: [round(min(v), 3), round(statistics.median(v), 3), round(max(v), 3)]
                         for k, v in {"startup_s_per_engine": [x for r in rs for x in r["startup_s"]],
                                      "rss_gib_per_engine": [r["rss_gib_per_engine"] for r in rs],
                                      "pss_gib_per_engine": [r["pss_gib_per_engine"] for r in rs],
                                      "cpu_s_per_session": [r["cpu_s_per_session"] for r in rs],
                                      "wall_s_per_session": [r["wall_s_per_session"] for r in rs]}.items()}
        summary[mode]["processes_for_two_engines"] = rs[0]["processes"]
    doc = {"tokens_equal": equal, "summary_min_median_max": summary,
           "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs], "args": vars(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(json.dumps({"tokens_equal": equal, "summary": summary}, indent=1))
    return 0 if equal else 1
