"""vLLM's own benchmark client as the driver of `python -m bench serve --driver vllm`.

``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs; called in this process, which hands
back its result dict with the per-request lists instead of a file to parse) with the
``prefix_repetition`` dataset in file order (``--disable-shuffle``) and the N decoders as
``--lora-modules`` assigned round-robin: the N consecutive requests of a prefix are N independent
``/v1/completions`` requests, one per decoder, over one shared context, as an agent framework
sends them. Each prefix carries a short suffix of its own per request (the agent's instruction).

The client's per-request record (start, TTFT, latency, tokens, error) is regrouped into the
project's sessions (one prefix = one fan-out of N agents), so the report, ratios and plots are
the same as with the project's client. The dataset turns on ``ignore_eos`` only for the
``random`` datasets; ``prefix_repetition`` does not send it, and none is passed here (the
benchmark's random models cannot emit EOS, so every request still generates its O tokens).
"""
from __future__ import annotations

import contextlib
import io

from bench.client import AgentTiming, SessionResult
from bench.workload import WorkloadSpec

SUFFIX_TOKENS = 16  # each request's own tokens after the shared prefix, like an agent's instruction


def client_argv(url: str, spec: WorkloadSpec, mode: str, load: float, sessions: int, tokenizer: str,
                models: list[str], seed: int) -> list[str]:
    """The arguments of one vLLM client run: ``sessions`` prefixes of ``spec.context_tokens`` tokens, each
    asked by every model once. ``mode`` "rate": ``load`` sessions/s, so N x load requests/s (Poisson per
    request); "concurrency": ``load`` sessions in flight, so N x load requests at most."""
    n = spec.fanout
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", models[0], "--tokenizer", tokenizer,
            "--dataset-name", "prefix_repetition", "--disable-shuffle",
            "--prefix-repetition-prefix-len", str(spec.context_tokens),
            "--prefix-repetition-suffix-len", str(SUFFIX_TOKENS),
            "--prefix-repetition-num-prefixes", str(sessions),
            "--prefix-repetition-output-len", str(spec.output_tokens),
            "--num-prompts", str(sessions * n),
            "--lora-modules", *models[:n], "--lora-assignment", "round-robin",
            "--temperature", "0", "--seed", str(seed), "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-detailed", "--disable-tqdm"]
    if mode == "rate":
        return argv + ["--request-rate", f"{load * n:g}"]
    return argv + ["--request-rate", "inf", "--max-concurrency", str(int(load) * n)]


def run_client(argv: list[str]) -> dict:
    """One run of vLLM's client in this process; its result dict (per-request lists included)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):  # its own summary table; the report prints ours
        return main(args)


def sessions_of(result: dict, n: int, models: list[str]) -> tuple[list[SessionResult], float, float]:
    """(sessions, t0, t_end): request i belongs to prefix i // n, its model is ``models[i % n]``
    (file order and round-robin). A session's fan-out latency runs from its first request's send to
    its last answer's end."""
    starts, ttfts, lats = result["start_times"], result["ttfts"], result["latencies"]
    outs, ins, errs = result["output_lens"], result["input_lens"], result["errors"]
    sessions = []
    for k in range(len(starts) // n):
        idx = range(k * n, (k + 1) * n)
        sent = min(starts[i] for i in idx)
        res = SessionResult(k, sent, sent)
        for i in idx:
            ok = not errs[i]
            res.agents.append(AgentTiming(0, models[i % n], starts[i], ttft_s=ttfts[i] if ok else None,
                                          e2e_s=lats[i] if ok else None, prompt_tokens=ins[i],
                                          completion_tokens=outs[i] if ok else 0, error=errs[i][:300] or None))
        if all(a.error is None for a in res.agents):
            res.done = max(a.start + a.e2e_s for a in res.agents)
            res.rounds_s = [res.done - sent]
        sessions.append(res)
    # the run's span: first send to last answer, of any request
    ends = [a.start + a.e2e_s for s in sessions for a in s.agents if a.e2e_s is not None]
    t0 = min((s.sent for s in sessions), default=0.0)
    return sessions, t0, max(ends, default=t0 + float(result.get("duration") or 0.0))
