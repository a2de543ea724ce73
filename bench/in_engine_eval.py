"""`python -m bench in-engine-eval`: the chat suite's held-out exact match, its adapters served in-engine.

One vLLM engine on the shipped base holds the four chat-format adapters as in-engine LoRA decoders
(``EngineConfig.handover_adapters``: the base's prefix cache up to the hand-over point, each adapter
from there on), as serve_config.yaml's base module serves them. Every held-out record
(checkpoints/chat/data/test.jsonl) is rendered as its decoder was trained (its manifest's chat
template and layout), answered greedily, and scored as ``prefillshare eval`` scores it (the text up
to </s>, parsed). The table prints beside the offline PrefillShare column of
checkpoints/chat/eval/results.json, which transformers computed on the same records.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ("lookup", "tool_call", "reschedule", "route")


async def _answers(engine, prompts: list[list[int]], lora: str, max_tokens: list[int]) -> list[list[int]]:
    from prefillshare.app.sampling import Sampling

    outs = await asyncio.gather(*[engine.complete(p, Sampling(max_tokens=m, temperature=0.0), lora=lora)
                                  for p, m in zip(prompts, max_tokens)])
    return [list(o.token_ids) for o in outs]


async def evaluate(args) -> dict:
    from prefillshare.app.engine.async_engine import Engine, EngineConfig
    from prefillshare.app.engine_args import CPU_ENGINE_ENV
    from prefillshare.app.rendering import Renderer
    from prefillshare.app.training import tasks
    from prefillshare.app.training.tokenizer import load_tokenizer

    ck = Path(args.checkpoints)
    tok = load_tokenizer(ck / "base")
    eos = tok.eos_token_id
    records = [json.loads(line) for line in (ck / "chat" / "data" / "test.jsonl").read_text().splitlines() if line]
    adapters = tuple((f"chat-{a}", str(ck / "chat" / "adapters" / a)) for a in AGENTS)
    engine = await Engine.start(EngineConfig(
        model=str(ck / "base"), dtype=args.dtype, lora_adapters=adapters, max_lora_rank=8,
        handover_adapters=tuple(n for n, _ in adapters), max_model_len=1024, max_num_seqs=16,
        extra_env={**CPU_ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}))
    offline = json.loads((ck / "chat" / "eval" / "results.json").read_text())
    rows = {}
    try:
        for agent in AGENTS:
            renderer = Renderer.for_decoder(ck / "chat" / "adapters" / agent)
            mine = [r for r in records if r["agent"] == agent][: args.limit]
            encoded = [renderer.training_ids(tok, [(m["role"], m["content"]) for m in r["messages"]]) for r in mine]
            t0 = time.perf_counter()
            outs = await _answers(engine, [p for p, _ in encoded], f"chat-{agent}", [len(a) + 2 for _, a in encoded])
            right = 0
            for (_, answer), out in zip(encoded, outs):
                want = tasks.parse_response(tok.decode(answer[:-1]))
                got = tasks.parse_response(tok.decode(out[: out.index(eos)])) if eos in out else None
                right += got == want
            rows[agent] = {"n": len(mine), "in_engine_em": round(100.0 * right / len(mine), 1),
                           "offline_prefillshare_em": _offline(offline, agent),
                           "seconds": round(time.perf_counter() - t0, 1)}
            print(f"{agent}: in-engine {rows[agent]['in_engine_em']}% EM over {len(mine)}, offline "
                  f"{rows[agent]['offline_prefillshare_em']}% ({rows[agent]['seconds']} s)", flush=True)
    finally:
        engine.shutdown()
    result = {"dtype": args.dtype, "limit": args.limit, "agents": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


def _offline(results: dict, agent: str) -> float | None:
    """The offline table's PrefillShare exact match of ``agent`` (checkpoints/chat/eval/results.json)."""
    return results.get("agents", {}).get(agent, {}).get("prefillshare", {}).get("exact_match")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoints", default=str(ROOT / "checkpoints"))
    p.add_argument("--dtype", default="float32", help="the offline table was computed in float32 on CPUs")
    p.add_argument("--limit", type=int, default=None, help="records per agent (default: all)")
    p.add_argument("--out", help="JSON file for the table")
    p.set_defaults(func=lambda a: asyncio.run(evaluate(a)) and 0)
