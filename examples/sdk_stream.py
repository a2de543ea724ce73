"""Stream several agents at once: one async iterator per agent over a single request.

    python examples/sdk_stream.py --url http://127.0.0.1:8000 [--models lookup route]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys

from prefillshare.agents import Agent, AsyncClient, Sampling, one_line
from prefillshare.app.training.tasks import AGENTS as TASKS
from prefillshare.app.training.tasks import Record

RECORD = Record((("item", "desk"), ("name", "omar"), ("city", "rome"), ("qty", "2"), ("day", "fri")),
                ("fragile", "handle", "with", "care"))
CONTEXT = RECORD.text()


def instruction(model: str) -> str:
    """The task suite's instruction for a served model (app/training/tasks.py)."""
    return TASKS.get(model, TASKS["lookup"])(RECORD, random.Random(3))[0]


async def run(url: str, max_tokens: int, models: list[str] | None = None) -> int:
    async with AsyncClient(url, timeout=120) as client:
        models = models or [m.id for m in await client.models()]
        agents = [Agent(m, instruction(m), sampling=Sampling(max_tokens=max_tokens)) for m in models]
        async with client.stream(CONTEXT, agents) as stream:

            async def follow(name: str) -> str:
                text = ""
                async for delta in stream.agent(name):
                    text += delta  # each delta arrives as the decoder produces it
                return text

            texts = await asyncio.gather(*(follow(a.label) for a in agents))
            result = await stream.result()
    for agent, text in zip(agents, texts):
        r = result[agent.label]
        ttft = f"{r.timings.ttft_s * 1000:.0f} ms" if r.timings.ttft_s is not None else "n/a"
        print(f"[{agent.label}] {one_line(text)}")
        print(f"    first text after {ttft}, done after {r.timings.total_s * 1000:.0f} ms, "
              f"{r.usage.cached_tokens}/{r.usage.prompt_tokens} prompt tokens from the shared prefill")
    return 1 if result.failures else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("PREFILLSHARE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--models", nargs="*", help="decoders to ask (default: every served model)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    return asyncio.run(run(args.url, args.max_tokens, args.models))


if __name__ == "__main__":
    sys.exit(main())
