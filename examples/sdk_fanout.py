"""Fan one order record out to several agents with one call; print what each said and what
sharing the prefill saved.

    python examples/sdk_fanout.py --url http://127.0.0.1:8000 [--models lookup route]
"""
from __future__ import annotations

import argparse
import os
import random
import sys

from prefillshare.agents import Agent, Client, Sampling, one_line
from prefillshare.app.training.tasks import AGENTS as TASKS
from prefillshare.app.training.tasks import Record

# One order record; the shipped decoders were trained on this format (app/training/tasks.py),
# so the task suite writes each agent's instruction and the answer it should give.
RECORD = Record((("name", "maya"), ("item", "lamp"), ("qty", "3"), ("city", "oslo"), ("day", "tue")),
                ("please", "call", "before", "noon"))
CONTEXT = RECORD.text()


def task(model: str) -> tuple[str, str]:
    """(instruction, expected answer) for a served model; unknown models get the lookup task."""
    return TASKS.get(model, TASKS["lookup"])(RECORD, random.Random(7))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("PREFILLSHARE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--models", nargs="*", help="decoders to ask (default: every served model)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)

    with Client(args.url, timeout=120) as client:
        models = args.models or [m.id for m in client.models()]
        agents = [Agent(m, task(m)[0], sampling=Sampling(max_tokens=args.max_tokens)) for m in models]
        result = client.run(CONTEXT, agents)

    for r in result.results:
        where = f"shared prefill on {r.prefill.module}" if r.shared_prefill else "private prefill"
        print(f"[{r.name}] {one_line(r.text)}")
        print(f"    expected: {task(r.model)[1]}")
        print(f"    {r.usage.prompt_tokens} prompt tokens ({r.usage.cached_tokens} loaded, {where}), "
              f"{r.usage.completion_tokens} generated, finish={r.finish_reason}" + (f", ERROR {r.error}" if r.error else ""))
    u = result.usage
    print(f"run {result.id}: {result.elapsed_s * 1000:.0f} ms; decoders loaded {u.cached_tokens} of "
          f"{u.prompt_tokens} prompt tokens ({u.saved_fraction:.0%}); prefill computed {u.prefill_tokens_computed}")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
