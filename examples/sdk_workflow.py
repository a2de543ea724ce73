"""A three-round workflow: look something up, let workers act on it, then check the result.
Round outputs join the shared context of the next round (on the server, one request), or
with a custom join on the client (one request per round).

    python examples/sdk_workflow.py --url http://127.0.0.1:8000 [--models lookup tool_call verify] [--client-join]
"""
from __future__ import annotations

import argparse
import os
import sys

from prefillshare.agents import Agent, Client, Sampling, Workflow, one_line

CONTEXT = "order\nname: lena\nitem: clock\nqty: 5\ncity: lima\nday: wed\nnote: leave at door"
# Instruction templates in the task suite's format (app/training/tasks.py): a question, then
# a line naming the field the answer is about.


def build(models: list[str], client_join: bool) -> Workflow:
    """First served model looks up, the others work in parallel, the last one checks."""
    s = Sampling(max_tokens=16)
    first, *rest = models
    planner = Agent(first, "Q: what is the\n{field}", name="planner", sampling=s)
    workers = [Agent(m, "Q: call the shipping tool.\ntool", name=f"worker-{m}", sampling=s) for m in rest] or \
              [Agent(first, "Q: what is the\nitem", name="worker", sampling=s)]
    checker = Agent(models[-1], "Q: yes or no?\n{field} {expected}", name="checker", sampling=s)
    if client_join:
        def notes(context, results):
            return context + "".join(f"\nnote:{r.name} answered {r.text.strip()}" for r in results if r.ok)
        return Workflow.pipeline(planner, workers, checker, join=notes)
    return Workflow.pipeline(planner, workers, checker)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("PREFILLSHARE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--models", nargs="*", help="decoders, first to last (default: every served model; each worker's "
                                               "answer joins the context, so many models need a long max_model_len)")
    p.add_argument("--client-join", action="store_true", help="join round outputs on the client")
    args = p.parse_args(argv)
    with Client(args.url, timeout=180) as client:
        models = args.models or [m.id for m in client.models()]
        wf = build(models, args.client_join)
        result = client.run_workflow(wf, CONTEXT, variables={"field": "city", "expected": "lima"})
    for i, round_results in enumerate(result.rounds):
        for r in round_results:
            print(f"[{r.name}] round {i}: {one_line(r.text)}" + (f" ERROR {r.error}" if r.error else ""))
    print(f"final context has {len(result.final_context.splitlines())} lines; "
          f"{result.usage.cached_tokens}/{result.usage.prompt_tokens} prompt tokens came from shared prefill")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
