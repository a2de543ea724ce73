"""In-engine LoRA decoders on one device: tokens against transformers, and the base's prefix cache shared.

One engine on the shipped base holds the four chat-format adapters as in-engine decoders
(``EngineConfig.handover_adapters``, app/engine/vllm_plugin.py), as serve_config.yaml's base module
serves them; float32, so greedy tokens compare with transformers on the same device.

- tokens: 4 rendered held-out prompts per adapter, 8 greedy tokens each, against
  ``prefillshare.app.reference.shared_greedy`` (base KV for every prompt token but the last, then
  base + adapter); and base requests in the same engine against the base alone.
- sharing: the four adapters at once over one long prompt of one tenant: every full block before
  the hand-over point read from the base's prefix cache (``num_cached_tokens``), vLLM's own
  ``vllm:prefix_cache_*`` counters over the fan-out, and another tenant's request that reads none.
- alora: two Activated LoRA adapters made here with PEFT's own aLoRA support (bench/alora.py) in
  the same engine: their greedy tokens against PEFT's ``generate()`` on two prompts each, and a
  fan-out of both over the long context, each invoked at its end, which computes it once.

    python -m bench.in_engine_probe --device cuda|cpu --out FILE.json

Run by bench/gpu_check.py's ``in_engine`` step (and its CPU dry run), which fails on the JSON's
``failures``; the exit code is 0 once the probe has run, whatever it found.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ("lookup", "tool_call", "reschedule", "route")
MAX_NEW = 8
BLOCK = 32


def _prompts(ck: Path, tok) -> dict[str, list[list[int]]]:
    from prefillshare.app.rendering import Renderer

    records = [json.loads(line) for line in (ck / "chat" / "data" / "test.jsonl").read_text().splitlines() if line]
    out = {}
    for agent in AGENTS:
        renderer = Renderer.for_decoder(ck / "chat" / "adapters" / agent)
        mine = [r for r in records if r["agent"] == agent][:4]
        out[agent] = [renderer.chat_ids(tok, [(m["role"], m["content"]) for m in r["messages"][:-1]]) for r in mine]
    return out


def _long_prompt(prompts: dict[str, list[list[int]]], limit: int) -> list[int]:
    """Several held-out prompts back to back, under ``limit`` tokens: one shared context."""
    out: list[int] = []
    for ps in prompts.values():
        for p in ps:
            if len(out) + len(p) >= limit:
                return out
            out += p
    return out


def _counters() -> dict[str, float]:
    from prometheus_client import REGISTRY

    out = {}
    for fam in REGISTRY.collect():
        if fam.name.startswith("vllm:prefix_cache"):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def probe(args) -> dict:
    from bench import alora
    from prefillshare.app.engine.async_engine import Engine, EngineConfig
    from prefillshare.app.engine_args import CPU_ENGINE_ENV
    from prefillshare.app.sampling import Sampling
    from prefillshare.app.training.tokenizer import load_tokenizer

    ck = Path(args.checkpoints)
    tok = load_tokenizer(ck / "base")
    prompts = _prompts(ck, tok)
    activated = alora.train(Path(args.work) / "alora", ALORA, steps=40, ckpt=ck)
    adapters = tuple((f"chat-{a}", str(ck / "chat" / "adapters" / a)) for a in AGENTS)
    adapters += tuple((n, str(p)) for n, p in activated.items())
    gpu = {"gpu_memory_utilization": 0.3} if args.device == "cuda" else {
        "extra_env": {**CPU_ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}}
    t0 = time.perf_counter()
    engine = await Engine.start(EngineConfig(
        model=str(ck / "base"), dtype="float32", lora_adapters=adapters, max_lora_rank=8, block_size=BLOCK,
        handover_adapters=tuple(n for n, _ in adapters), max_model_len=1024, max_num_seqs=16, **gpu))
    result: dict = {"device": args.device, "engine_start_s": round(time.perf_counter() - t0, 1)}
    greedy = Sampling(max_tokens=MAX_NEW, temperature=0.0)
    try:
        served = {}
        for agent in AGENTS:  # an agent's prompts and the same prompts on the base, in one batch
            outs = await asyncio.gather(*[engine.complete(p, greedy, lora=f"chat-{agent}", cache_salt="tokens")
                                          for p in prompts[agent]],
                                        *[engine.complete(p, greedy, cache_salt="tokens") for p in prompts[agent]])
            served[agent] = [list(o.token_ids) for o in outs]
        long = _long_prompt(prompts, 1024 - MAX_NEW - 1)
        before = _counters()
        fan = await asyncio.gather(*[engine.complete(long, greedy, lora=f"chat-{a}", cache_salt="fan-out")
                                     for a in AGENTS])
        await asyncio.sleep(0.5)  # vLLM's stat logger records the last step's counters
        after = _counters()
        other = await engine.complete(long, greedy, lora="chat-route", cache_salt="another-tenant")
        invoked = {n: _invoked(prompts, tok, n) for n in ALORA}
        a_served = {n: [list((await engine.complete(p, greedy, lora=n, cache_salt="alora")).token_ids) for p in ps]
                    for n, ps in invoked.items()}
        a_long = {n: long[: 1024 - MAX_NEW - 16] + alora.invocation_ids(tok, n) for n in ALORA}
        a_before = _counters()
        a_fan = await asyncio.gather(*[engine.complete(p, greedy, lora=n, cache_salt="alora-fan") for n, p in a_long.items()])
        await asyncio.sleep(0.5)
        a_after = _counters()
    finally:
        engine.shutdown()
    result["alora"] = _alora_result(activated, invoked, a_served, a_long, a_fan, a_before, a_after, ck, args.device)
    result["tokens"] = _compare(ck, prompts, served, tok.eos_token_id, args.device)
    expected = (len(long) - 1) // BLOCK * BLOCK  # every full block before the hand-over point
    queries = after.get("vllm:prefix_cache_queries_total", 0.0) - before.get("vllm:prefix_cache_queries_total", 0.0)
    hits = after.get("vllm:prefix_cache_hits_total", 0.0) - before.get("vllm:prefix_cache_hits_total", 0.0)
    result["sharing"] = {
        "prompt_tokens": len(long), "cached_tokens": [o.num_cached_tokens for o in fan],
        "expected_cached_after_first": expected,
        "vllm_queries": queries, "vllm_hits": hits,
        # what the engine computed for the fan-out, in prompts (vLLM's counters): ~1 when shared
        "computed_over_one_prompt": round((queries - hits) / len(long), 3) if queries else None,
        "other_tenant_cached": other.num_cached_tokens,
    }
    cached = sorted(o.num_cached_tokens for o in fan)
    failures = [f"{a}: {m}" for a, m in result["tokens"]["mismatches"]]
    if cached[1:] != [expected] * (len(AGENTS) - 1):
        failures.append(f"sharing: cached tokens {cached}, every adapter after the first should read {expected}")
    if result["sharing"]["computed_over_one_prompt"] is None or result["sharing"]["computed_over_one_prompt"] > 1.1:
        failures.append(f"sharing: the fan-out computed {result['sharing']['computed_over_one_prompt']} prompts")
    if other.num_cached_tokens:
        failures.append(f"sharing: another tenant read {other.num_cached_tokens} cached tokens")
    failures += [f"alora: {f}" for f in result["alora"]["failures"]]
    result["failures"] = failures
    return result


ALORA = ("check", "route")  # bench/alora.py's adapters the probe makes


def _invoked(prompts: dict[str, list[list[int]]], tok, name: str) -> list[list[int]]:
    """Two held-out prompts with the adapter's invocation: at the end, and twice (the last counts)."""
    from bench import alora

    inv = alora.invocation_ids(tok, name)
    first, second = prompts[AGENTS[0]][:2]
    return [first + inv, first[:40] + inv + second[-40:] + inv]


def _alora_result(paths, invoked, served, long, fan, before, after, ck: Path, device: str) -> dict:
    from bench import alora

    failures, compared = [], 0
    for name, ps in invoked.items():
        want = alora.peft_greedy(paths[name], ps, MAX_NEW, ck, device)
        compared += len(ps)
        failures += [f"{name} prompt {i}: {g} != PEFT's {w}" for i, (g, w) in enumerate(zip(served[name], want)) if g != w]
    queries = after.get("vllm:prefix_cache_queries_total", 0.0) - before.get("vllm:prefix_cache_queries_total", 0.0)
    hits = after.get("vllm:prefix_cache_hits_total", 0.0) - before.get("vllm:prefix_cache_hits_total", 0.0)
    one = len(next(iter(long.values())))
    computed = round((queries - hits) / one, 3) if queries else None
    if computed is None or computed > 1.1:
        failures.append(f"the aLoRA fan-out computed {computed} prompts")
    return {"compared": compared, "computed_over_one_prompt": computed,
            "cached_tokens": [o.num_cached_tokens for o in fan], "failures": failures}


def _compare(ck: Path, prompts, served, eos: int, device: str) -> dict:
    """Served greedy tokens against transformers on ``device``: each adapter's hand-over, the base alone."""
    import torch

    from prefillshare.app.models.checkpoint import load_decoder, load_model
    from prefillshare.app.reference import private_greedy, shared_greedy

    dev = torch.device(device)
    base = load_model(ck / "base").to(dev)
    mismatches, differs_from_whole = [], 0
    for agent in AGENTS:
        decoder = load_decoder(ck / "chat" / "adapters" / agent, ck / "base").to(dev)
        n = len(prompts[agent])
        for i, p in enumerate(prompts[agent]):
            want = shared_greedy(base, decoder, p, MAX_NEW, eos)
            if served[agent][i] != want:
                mismatches.append((agent, f"prompt {i}: {served[agent][i]} != {want}"))
            differs_from_whole += private_greedy(decoder, p, MAX_NEW, eos) != want
            base_want = private_greedy(base, p, MAX_NEW, eos)
            if served[agent][n + i] != base_want:
                mismatches.append((agent, f"base on prompt {i}: {served[agent][n + i]} != {base_want}"))
    if not differs_from_whole:
        mismatches.append(("all", "the adapter on every prompt token answers as the hand-over does: no check"))
    return {"compared": sum(len(v) for v in prompts.values()) * 2, "mismatches": mismatches,
            "whole_prompt_differs": differs_from_whole}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--checkpoints", default=str(ROOT / "checkpoints"))
    ap.add_argument("--out", help="JSON file for the result")
    ap.add_argument("--work", default=str(ROOT / "runs" / "in_engine_probe"), help="where the aLoRA adapters are made")
    args = ap.parse_args(argv)
    result = asyncio.run(probe(args))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
