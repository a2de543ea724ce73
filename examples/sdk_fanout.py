"""Fan one order record out to several agents with one call; print what each said and what
sharing the prefill saved.

    python examples/sdk_fanout.py --url http://127.0.0.1:8000 [--models lookup verify]
"""
from __future__ import annotations

import argparse
import os
import sys

from agents import Agent, Client, Sampling

CONTEXT = "order\nname: maya\nitem: lamp\nqty: 3\ncity: oslo\nday: tue\nnote: please call before noon"
# Instructions in the format the shipped decoders were trained on (app/training/tasks.py).
INSTRUCTIONS = {
    "lookup": "what is the city?",
    "tool_call": "call the shipping tool.",
    "reschedule": "move the delivery one day later. which day?",
    "verify": "is the city oslo? yes or no.",
}


def one_line(text: str) -> str:
    return text.strip().replace("\n", "\\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("PREFILLSHARE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--models", nargs="*", help="decoders to ask (default: every served model)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)

    with Client(args.url, timeout=120) as client:
        models = args.models or [m.id for m in client.models()]
        agents = [Agent(m, INSTRUCTIONS.get(m, "what is the city?"), sampling=Sampling(max_tokens=args.max_tokens))
                  for m in models]
        result = client.run(CONTEXT, agents)

    for r in result.results:
        where = f"shared prefill on {r.prefill.module}" if r.shared_prefill else "private prefill"
        print(f"[{r.name}] {one_line(r.text)}")
        print(f"    {r.usage.prompt_tokens} prompt tokens ({r.usage.cached_tokens} loaded, {where}), "
              f"{r.usage.completion_tokens} generated, finish={r.finish_reason}" + (f", ERROR {r.error}" if r.error else ""))
    u = result.usage
    print(f"run {result.id}: {result.elapsed_s * 1000:.0f} ms; decoders loaded {u.cached_tokens} of "
          f"{u.prompt_tokens} prompt tokens ({u.saved_fraction:.0%}); prefill computed {u.prefill_tokens_computed}")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
