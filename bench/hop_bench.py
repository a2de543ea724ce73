"""`python -m bench hops`: what the Orchestrator's stream hop costs per generated token.

An agent run's tokens travel Decode -> Orchestrator -> caller: two Ray streams, because the
Orchestrator merges its agents' streams. A single-decoder completion streams from the decoder
to the Router directly: the Router runs its prefill itself (deployments/path/fanout.py). One app (one prefill module, one
decoder, the shipped checkpoints by default) is streamed three ways from the same driver,
rotating the order each round so that machine load hits all alike, at each concurrency:

  decoder  Decode.generate                   (one stream, no shared prefill: the floor)
  relay    Orchestrator.run, one agent       (shared prefill, Decode -> Orchestrator -> caller)
  direct   FanOut.prepare, then the          (shared prefill, Decode -> caller: the Router's
           decoder's stream (FanOut.decode)   completion path)

Per token is the time between a session's first and last streamed token over the tokens in
between, so the prefill (which differs between them) is left out; the relay's agent events carry
text, not token ids, so there its tokens come from the agent's usage and its chunks are the
text events. The Orchestrator's CPU seconds per streamed token are read from its process.
Results: a table and JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = "hops"


@dataclass(frozen=True)
class HopSpec:
    checkpoints: str = "checkpoints"  # relative: to the project root
    decoder: str = "lookup"
    concurrency: tuple[int, ...] = (1, 4)
    rounds: int = 6  # per path and concurrency, the paths rotating
    output_tokens: int = 64
    prompt_words: int = 60
    out: str = "runs/bench/hops.json"

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("--concurrency: give positive session counts, e.g. 1,4")
        if self.rounds < 1:
            raise ValueError("--rounds: at least 1")
        if self.output_tokens < 4:
            raise ValueError("--output-tokens: at least 4 (per-token time needs tokens after the first)")


@dataclass
class PathResult:
    path: str
    concurrency: int
    ms_per_token: list[float] = field(default_factory=list)  # one per session
    tokens_per_chunk: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)  # a round's sessions together, prefill included
    decode_tokens_per_s: list[float] = field(default_factory=list)  # tokens after each first, first to last token
    orchestrator_cpu_ms_per_token: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        med = statistics.median
        return {"path": self.path, "concurrency": self.concurrency,
                "ms_per_token": med(self.ms_per_token), "tokens_per_chunk": med(self.tokens_per_chunk),
                "tokens_per_s": med(self.tokens_per_s), "decode_tokens_per_s": med(self.decode_tokens_per_s),
                "orchestrator_cpu_ms_per_token": med(self.orchestrator_cpu_ms_per_token)}


def _checkpoints(spec: HopSpec) -> Path:
    return ROOT / spec.checkpoints  # an absolute path stays as it is


def app_config(spec: HopSpec, pool: str) -> dict:
    ck = _checkpoints(spec)
    engine = {"dtype": "auto", "max_model_len": 1024, "kv_cache_memory_bytes": "256MiB", "block_size": 32,
              "max_num_seqs": 16, "enforce_eager": True, "threads_bind": "nobind"}
    return {
        "tokenizer": str(ck / "tokenizer"),
        "pool": {"path": pool, "capacity_bytes": "256MiB"},
        "limits": {"max_tokens_default": spec.output_tokens, "max_tokens_cap": max(256, spec.output_tokens)},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "prefill_modules": [{"name": "base", "model": str(ck / "base"), "engine": engine,
                             "placement": {"num_replicas": 1, "num_cpus": 0.5}}],
        "decoders": [{"name": spec.decoder, "model": str(ck / "decoders" / spec.decoder), "engine": engine,
                      "placement": {"num_replicas": 1, "num_cpus": 0.25,
                                    "placement_group_bundles": [{"CPU": 0.25}]}}],
    }


def _orchestrator_process():
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        if any(f"ServeReplica:{APP}:Orchestrator" in part for part in (p.info["cmdline"] or [])):
            return p
    return None


def _cpu_s(p) -> float:
    if p is None:
        return float("nan")
    t = p.cpu_times()
    return t.user + t.system


PATHS = ("decoder", "relay", "direct")


async def _session(handles, path: str, spec: HopSpec, prompt: tuple[int, ...], sampling) -> tuple:
    """(tokens, chunks with tokens, first token time, last token time) of one streamed request."""
    from prefillshare.deployments.messages import AgentRunRequest, AgentSpec, DecodeRequest
    from prefillshare.deployments.path.fanout import Leg

    rid = f"hop-{uuid.uuid4().hex[:8]}"
    tokens = chunks = 0
    first = last = 0.0
    if path == "relay":
        run = AgentRunRequest(rid, "", ((AgentSpec("a", spec.decoder, "-", sampling, prompt),),))
        async for ev in handles["orch"].options(stream=True).run.remote(run):
            if ev.kind == "agent_done" and ev.result["error"]:
                raise RuntimeError(f"relay failed: {ev.result['error']}")
            if ev.kind == "delta":
                last = time.perf_counter()
                first = first or last
                chunks += 1
            elif ev.kind == "agent_done":
                tokens = ev.result["usage"]["completion_tokens"]
        return tokens, chunks, first, last
    if path == "direct":
        t0 = time.perf_counter()
        [plan] = await handles["fanout"].prepare([Leg(rid, spec.decoder, prompt, sampling)], rid, "completions", None)
        stream = handles["fanout"].decode(plan, t0).chunks()
    else:
        stream = handles["decode"].generate.remote(DecodeRequest(rid, prompt, sampling))
    async for chunk in stream:
        if chunk.error:
            raise RuntimeError(f"{path} failed: {chunk.error}")
        if chunk.delta_token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += len(chunk.delta_token_ids)
            chunks += 1
    return tokens, chunks, first, last


async def _round(handles, path: str, c: int, prompts: list[tuple[int, ...]], spec: HopSpec, sampling,
                 res: PathResult):
    proc = handles["orch_proc"]
    cpu0, t0 = _cpu_s(proc), time.perf_counter()
    out = await asyncio.gather(*[_session(handles, path, spec, prompts[i], sampling) for i in range(c)])
    wall, cpu = time.perf_counter() - t0, _cpu_s(proc) - cpu0
    total = 0
    for tokens, chunks, first, last in out:
        if tokens < 2 or chunks < 2:
            raise RuntimeError(f"{path}: a session streamed {tokens} token(s) in {chunks} chunk(s); "
                               "per-token time needs two")
        res.ms_per_token.append((last - first) / (tokens - 1) * 1e3)
        res.tokens_per_chunk.append(tokens / chunks)
        total += tokens
    res.tokens_per_s.append(total / wall)
    span = max(last for *_, last in out) - min(first for _, _, first, _ in out)
    res.decode_tokens_per_s.append(sum(tokens - 1 for tokens, *_ in out) / span)
    res.orchestrator_cpu_ms_per_token.append(cpu / total * 1e3)


def _workload(spec: HopSpec, n: int) -> tuple[list[tuple[int, ...]], object]:
    """Distinct prompts (no prefix-cache hit across sessions or rounds) of about the same length,
    and one sampling for all: ``output_tokens`` each, special tokens banned so that every token
    is text (an agent run's events carry text only; a trained decoder would otherwise emit
    end-of-sequence tokens past its answer, which stream as tokens without text)."""
    from transformers import AutoTokenizer

    from prefillshare.app.sampling import Sampling

    tok = AutoTokenizer.from_pretrained(str(_checkpoints(spec) / "tokenizer"))
    words = ("maya", "lamp", "oslo", "teal", "noon", "rome", "lima", "kyiv", "doha", "pear", "fig", "desk")
    out = []
    for i in range(n):
        text = " ".join(f"{words[(i * 7 + j) % len(words)]}{(i * 31 + j) % 97}" for j in range(spec.prompt_words))
        out.append(tuple(tok(text)["input_ids"]))
    ban = tuple((i, -100.0) for i in sorted(set(tok.all_special_ids)))
    return out, Sampling(max_tokens=spec.output_tokens, ignore_eos=True, logit_bias=ban)


async def _measure(spec: HopSpec, plan) -> list[dict]:
    """``plan``: the app's AppPlan (the Router's FanOut runs on it)."""
    from ray import serve

    from prefillshare.deployments.path.fanout import FanOut
    from prefillshare.deployments.path.serve_engines import ServeEngines

    engines = ServeEngines({"base": serve.get_deployment_handle("Prefill-base", APP)},
                           {spec.decoder: serve.get_deployment_handle(f"Decode-{spec.decoder}", APP)})
    handles = {"decode": serve.get_deployment_handle(f"Decode-{spec.decoder}", APP).options(stream=True),
               "fanout": FanOut(plan, engines),
               "orch": serve.get_deployment_handle("Orchestrator", APP),
               "orch_proc": _orchestrator_process()}
    prompts, sampling = _workload(spec, len(PATHS) * (1 + sum(spec.rounds * c for c in spec.concurrency)))
    it = iter(prompts)
    # warm every path (engine graphs, handle routers, the orchestrator's tokenizer)
    for path in PATHS:
        await _round(handles, path, 1, [next(it)], spec, sampling, PathResult(path, 1))
    rows = []
    for c in spec.concurrency:
        results = {p: PathResult(p, c) for p in PATHS}
        for r in range(spec.rounds):
            for path in PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]:  # each path leads in turn
                await _round(handles, path, c, [next(it) for _ in range(c)], spec, sampling, results[path])
        s = {p: results[p].summary() for p in PATHS}
        print(f"{c} session(s): " + ", ".join(f"{s[p]['ms_per_token']:.2f} ms/token {p}" for p in PATHS),
              file=sys.stderr)
        row = {"concurrency": c, **s, "raw": {p: asdict(results[p]) for p in PATHS}}
        for p in ("relay", "direct"):
            row[f"ratio_ms_per_token_{p}"] = s[p]["ms_per_token"] / s["decoder"]["ms_per_token"]
        row["ratio_ms_per_token_direct_vs_relay"] = s["direct"]["ms_per_token"] / s["relay"]["ms_per_token"]
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    lines = ["| sessions | ms/token decoder | ms/token relay | ms/token direct | relay/decoder | direct/decoder | "
             "decode tokens/s decoder / relay / direct | Orchestrator CPU ms/token decoder / relay / direct |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [str(r["concurrency"]), *(f"{r[p]['ms_per_token']:.2f}" for p in PATHS),
                 *(f"{r[f'ratio_ms_per_token_{p}']:.2f}x" for p in ("relay", "direct")),
                 " / ".join(f"{r[p]['decode_tokens_per_s']:.0f}" for p in PATHS),
                 " / ".join(f"{r[p]['orchestrator_cpu_ms_per_token']:.2f}" for p in PATHS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(spec: HopSpec) -> dict:
    import ray
    from ray import serve

    from prefillshare.app.config import load_config
    from prefillshare.app.plan import plan_app
    from prefillshare.deployments.application import build

    pool = f"/dev/shm/ps-hops-{os.getpid()}"
    cfg = load_config(app_config(spec, pool))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        t0 = time.perf_counter()
        serve.run(build(cfg), name=APP, route_prefix=None)
        ready_s = time.perf_counter() - t0
        print(f"app up in {ready_s:.0f} s", file=sys.stderr)
        rows = asyncio.run(_measure(spec, plan_app(cfg)))
    finally:
        serve.shutdown()
        ray.shutdown()
        import shutil

        shutil.rmtree(pool, ignore_errors=True)
    load = os.getloadavg()
    report = {"spec": asdict(spec), "app_ready_s": ready_s, "loadavg": load, "rows": rows}
    Path(spec.out).parent.mkdir(parents=True, exist_ok=True)
    Path(spec.out).write_text(json.dumps(report, indent=1))
    print(render(rows))
    print(f"(app up in {ready_s:.0f} s; load average {load[0]:.1f}; JSON: {spec.out})")
    return report


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `python -m bench hops`."""
    d = HopSpec()
    parser.add_argument("--checkpoints", default=d.checkpoints, help="folder with base/, decoders/, tokenizer/")
    parser.add_argument("--decoder", default=d.decoder)
    parser.add_argument("--concurrency", type=_ints, default=d.concurrency, help="sessions at once, e.g. 1,4")
    parser.add_argument("--rounds", type=int, default=d.rounds)
    parser.add_argument("--output-tokens", type=int, default=d.output_tokens)
    parser.add_argument("--out", default=d.out)
    parser.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    try:
        spec = HopSpec(checkpoints=args.checkpoints, decoder=args.decoder, concurrency=args.concurrency,
                       rounds=args.rounds, output_tokens=args.output_tokens, out=args.out)
    except ValueError as e:
        print(f"bench hops: {e}", file=sys.stderr)
        return 2
    run(spec)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    configure(p)
    a = p.parse_args()
    sys.exit(a.func(a))
