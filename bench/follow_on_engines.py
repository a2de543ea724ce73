"""The engines of a follow-on completion without Ray: what the two engine steps cost by themselves.

Builds the same engines as bench/bench_follow_on_ttft.py's app (the shipped base as prefill
module with the pool's producer connector and prefix caching; the chat LoRA decode group as
consumer) and, with ``--stock``, one stock engine instead (the base with the four adapters and
prefix caching, no connector). Each request: a 768-token prefix shared by all, a 32-token random
suffix, adapters round-robin, one at a time. Prints the median prefill time, the decode group's
time to its first token and their sum (or the stock engine's time to first token), as JSON.

``--idle-sweep`` measures instead how an engine's first token depends on how long it sat idle
before the request: the decode group alone, one-token prompts (nothing to load), adapters
round-robin, each idle gap in turn; per gap the median first token and the median step after it.
In a disaggregated path each engine idles while the other works, so each pays this; one stock
engine serving requests back to back does not.

    .venv/bin/python -m bench.follow_on_engines [--stock | --idle-sweep] [--requests 24]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def _first_token(engine, ids, rid, lora) -> float:
    from prefillshare.app.sampling import Sampling

    t0 = time.perf_counter()
    async for out in engine.generate(ids, Sampling(max_tokens=8, temperature=0), rid, lora=lora):
        if out.new_token_ids:
            break
    return time.perf_counter() - t0


async def _idle_sweep(engine, names: list[str], requests: int, gaps=(0.0, 0.002, 0.01, 0.05, 0.15, 0.5)) -> dict:
    """Per idle gap (s): median first token and median later step (ms) of three-token answers."""
    from prefillshare.app.sampling import Sampling

    out = {}
    for gap in gaps:
        first, step = [], []
        for i in range(requests):
            t0, stamps = time.perf_counter(), []
            async for o in engine.generate([11 + i % 300], Sampling(max_tokens=3, temperature=0, ignore_eos=True),
                                           f"idle{gap}-{i}", lora=names[i % len(names)]):
                stamps += [time.perf_counter() - t0] * len(o.new_token_ids)
            first.append(stamps[0])
            step.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
            await asyncio.sleep(gap)
        out[f"{gap:g}"] = {"first_token_ms": round(statistics.median(first[2:]) * 1e3, 2),
                           "step_ms": round(statistics.median(step[2:]) * 1e3, 2)}
    return {"idle_s": out, "requests": requests}


async def main(args) -> dict:
    from bench import bench_follow_on_ttft as bench
    from prefillshare.app.config import load_config
    from prefillshare.app.engine.async_engine import Engine
    from prefillshare.app.engine.pool.handover import PoolHandover, connector_config
    from prefillshare.app.engine_args import engine_config
    from prefillshare.app.plan import plan_app

    pool_dir = f"/dev/shm/ps-follow-on-engines-{os.getpid()}"
    cfg = load_config(bench.app_config(pool_dir))
    plan = plan_app(cfg)
    base, group = cfg.prefill_modules[0], cfg.decoders[0]
    names = [a.name for a in group.adapters]
    rng = random.Random(0)
    prefix = [rng.randrange(10, 500) for _ in range(768)]
    prompts = [prefix + [rng.randrange(10, 500) for _ in range(32)] for _ in range(args.requests)]
    warm = 2  # the first requests fill the prefix cache and the pool
    if args.idle_sweep:
        engine = await Engine.start(engine_config(cfg, group.model, group.engine, group.placement, None, group))
        try:
            return await _idle_sweep(engine, names, args.requests)
        finally:
            engine.shutdown()
            shutil.rmtree(pool_dir, ignore_errors=True)
    if args.stock:
        ec = replace(engine_config(cfg, base.model, base.engine, base.placement, None, group), enable_prefix_caching=True)
        engine = await Engine.start(ec)
        try:
            ttft = []
            for i, ids in enumerate(prompts):
                ttft.append(await _first_token(engine, ids, f"s{i}", names[i % len(names)]))
                await asyncio.sleep(0.2)
        finally:
            engine.shutdown()
        return {"stock_first_token_ms": statistics.median(ttft[warm:]) * 1e3, "requests": args.requests}
    pool = PoolHandover.from_config(cfg).pool
    module_id = plan.module(base.name).module_id
    pe = await Engine.start(replace(engine_config(
        cfg, base.model, base.engine, base.placement,
        connector_config("producer", module_id, pool, scope=base.name), base), enable_prefix_caching=True))
    de = await Engine.start(replace(engine_config(
        cfg, group.model, group.engine, group.placement,
        connector_config("consumer", module_id, pool, scope=group.name), group), enable_prefix_caching=False))
    try:
        prefill, decode = [], []
        for i, ids in enumerate(prompts):
            t0 = time.perf_counter()
            await pe.prefill(ids, f"p{i}", kv_transfer_params={"fanout": 1})
            prefill.append(time.perf_counter() - t0)
            decode.append(await _first_token(de, ids, f"d{i}", names[i % len(names)]))
            await asyncio.sleep(0.2)
    finally:
        pe.shutdown()
        de.shutdown()
        shutil.rmtree(pool_dir, ignore_errors=True)
    med = lambda xs: statistics.median(xs[warm:]) * 1e3  # noqa: E731
    return {"prefill_ms": med(prefill), "decode_first_token_ms": med(decode),
            "sum_ms": med([p + d for p, d in zip(prefill, decode)]), "requests": args.requests}


if __name__ == "__main__":  # engine cores start with spawn: nothing may start at import
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stock", action="store_true", help="one stock engine instead of the app's two")
    mode.add_argument("--idle-sweep", action="store_true", help="the decode group's first token after idle gaps")
    parser.add_argument("--requests", type=int, default=24)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
