"""`python -m bench soak`: mixed traffic against a running app for a fixed time, then errors and drift.

A soak answers "does it stay correct and as fast after a while", which a benchmark's short run
cannot: ``concurrency`` users send fan-outs (`/v1/agents/run`) and completions
(`/v1/completions`) back to back for ``duration_s``; every answer is classified (ok, or an error
code), latencies are grouped in windows of ``window_s`` by send time, and the report gives
p50/p95 per window and kind plus the p95 drift (last window / first window). The app's own
accounting (`/ready` admission counts) is read before and after, so the report also shows
whether every request the client sent is accounted for on the server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

Kind = Literal["fanout", "completion"]
KINDS: tuple[Kind, ...] = ("fanout", "completion")
_WORDS = ("maya", "lamp", "oslo", "teal", "tue", "noon", "rome", "lima", "kyiv", "doha", "pear", "fig")
_QUESTIONS = ("what is k1?", "what is k3?", "which key holds teal?", "call the lookup tool.", "how many keys?")


@dataclass(frozen=True)
class SoakSpec:
    url: str
    duration_s: float = 120.0
    concurrency: int = 4
    window_s: float = 60.0
    models: tuple[str, ...] = ()  # empty: every model of GET /v1/models
    fanout: int = 2  # agents per fan-out request
    fanout_share: float = 0.5  # fraction of requests that are fan-outs
    records: int = 6  # key:value lines per context (keep the prompt within the decoders' context)
    contexts: int = 8  # distinct contexts, so the prefill prefix cache is hit and missed
    max_tokens: int = 8
    timeout_s: float = 120.0
    api_key: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("duration_s", "window_s", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"soak {name} must be > 0")
        for name in ("concurrency", "fanout", "records", "contexts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"soak {name} must be >= 1")
        if not 0 <= self.fanout_share <= 1:
            raise ValueError("soak fanout_share must be in [0, 1]")


@dataclass(frozen=True)
class Sample:
    kind: Kind
    sent_s: float  # since the soak started
    latency_s: float
    error: str | None  # None: ok; else a code such as "429 overloaded", "agent overloaded", "timeout"


@dataclass
class Window:
    index: int
    start_s: float
    requests: int = 0
    errors: int = 0
    p50_s: dict[str, float | None] = field(default_factory=dict)
    p95_s: dict[str, float | None] = field(default_factory=dict)


@dataclass
class SoakReport:
    duration_s: float  # wall time, the drain of the last requests included
    sent: int
    ok: int
    errors: dict[str, int]
    windows: list[Window]
    p95_drift: dict[str, float | None]  # last window's p95 / first window's p95, per kind
    server: dict | None  # /ready admission deltas over the soak, None when unreadable


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def summarize(samples: list[Sample], duration_s: float, window_s: float, wall_s: float,
              server: dict | None = None) -> SoakReport:
    """Group samples in windows of ``window_s`` by send time (a last, shorter window when
    ``duration_s`` is not a multiple); p50/p95 over the ok ones, per kind."""
    n_windows = max(1, math.ceil(duration_s / window_s - 1e-9))
    windows = [Window(i, i * window_s) for i in range(n_windows)]
    lat: dict[tuple[int, str], list[float]] = {}
    errors: dict[str, int] = {}
    for s in samples:
        w = windows[min(int(s.sent_s // window_s), n_windows - 1)]
        w.requests += 1
        if s.error is None:
            lat.setdefault((w.index, s.kind), []).append(s.latency_s)
        else:
            w.errors += 1
            errors[s.error] = errors.get(s.error, 0) + 1
    for w in windows:
        for k in KINDS:
            w.p50_s[k] = percentile(lat.get((w.index, k), []), 50)
            w.p95_s[k] = percentile(lat.get((w.index, k), []), 95)
    drift: dict[str, float | None] = {}
    for k in KINDS:
        p95s = [w.p95_s[k] for w in windows if w.p95_s[k] is not None]
        drift[k] = p95s[-1] / p95s[0] if len(p95s) >= 2 and p95s[0] > 0 else None
    ok = sum(1 for s in samples if s.error is None)
    return SoakReport(wall_s, len(samples), ok, dict(sorted(errors.items())), windows, drift, server)


def _context(i: int, records: int) -> str:
    rng = random.Random(i)
    return f"soak {i}\n" + "\n".join(f"k{j}:{rng.choice(_WORDS)}" for j in range(records))


def _http_error(status: int, raw: bytes) -> str:
    try:
        code = json.loads(raw)["error"]["code"]
    except Exception:  # noqa: BLE001 - not our JSON error shape: the status alone
        code = "?"
    return f"{status} {code}"


class Soaker:
    """The traffic: one shared HTTP client, ``concurrency`` users in a closed loop."""

    def __init__(self, spec: SoakSpec, models: list[str]):
        self.spec = spec
        self.models = models
        self.headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        self.contexts = [_context(spec.seed * 1000 + i, spec.records) for i in range(spec.contexts)]

    def _request(self, rng: random.Random) -> tuple[Kind, str, dict]:
        s = self.spec
        ctx = rng.choice(self.contexts)
        if rng.random() < s.fanout_share:
            agents = [{"name": f"a{i}", "model": rng.choice(self.models), "instruction": rng.choice(_QUESTIONS),
                       "max_tokens": s.max_tokens, "temperature": 0} for i in range(s.fanout)]
            return "fanout", "/v1/agents/run", {"context": ctx, "agents": agents}
        prompt = f"{ctx}\nQ: {rng.choice(_QUESTIONS)}\nA:"
        return "completion", "/v1/completions", {"model": rng.choice(self.models), "prompt": prompt,
                                                 "max_tokens": s.max_tokens, "temperature": 0}

    async def _one(self, client, kind: Kind, path: str, body: dict, t0: float) -> Sample:
        sent = time.perf_counter()
        error: str | None = None
        try:
            r = await client.post(self.spec.url + path, json=body, headers=self.headers)
            if r.status_code != 200:
                error = _http_error(r.status_code, r.content)
            elif kind == "fanout":
                agent_errors = [a["error"] for a in r.json().get("results", []) if a.get("error")]
                if agent_errors:  # the run answered, an agent failed: its reason's code
                    error = "agent " + agent_errors[0].split(":")[0]
                elif len(r.json().get("results", [])) != len(body["agents"]):
                    error = "agent missing"
            elif not r.json().get("choices"):
                error = "no choices"
        except Exception as e:  # noqa: BLE001 - a failed request is a data point
            error = "timeout" if "Timeout" in type(e).__name__ else f"client {type(e).__name__}"
        return Sample(kind, sent - t0, time.perf_counter() - sent, error)

    async def run(self) -> tuple[list[Sample], float]:
        import httpx

        samples: list[Sample] = []
        async with httpx.AsyncClient(timeout=self.spec.timeout_s,
                                     limits=httpx.Limits(max_connections=self.spec.concurrency + 4)) as client:
            t0 = time.perf_counter()

            async def user(u: int) -> None:
                rng = random.Random(self.spec.seed * 7919 + u)
                while time.perf_counter() - t0 < self.spec.duration_s:
                    samples.append(await self._one(client, *self._request(rng), t0))

            await asyncio.gather(*[user(u) for u in range(self.spec.concurrency)])
            return samples, time.perf_counter() - t0


def _get_json(url: str, api_key: str | None, timeout: float = 30.0) -> tuple[int, dict | None]:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        return r.status_code, r.json()
    except Exception:  # noqa: BLE001
        return 0, None


def _admission(url: str) -> dict | None:
    _, body = _get_json(url + "/ready", None)
    return (body or {}).get("admission")


def server_delta(before: dict | None, after: dict | None) -> dict | None:
    """The app's own counts over the soak (one Router replica: they cover every request)."""
    if not before or not after or "outcomes" not in after:
        return None

    def outcomes(a: dict) -> dict[str, int]:
        out: dict[str, int] = {}
        for counts in a.get("outcomes", {}).values():
            for k, v in counts.items():
                out[k] = out.get(k, 0) + v
        return out

    ob, oa = outcomes(before), outcomes(after)
    delta = {k: after[k] - before[k] for k in ("admitted", "rejected")}
    delta.update({k: oa.get(k, 0) - ob.get(k, 0) for k in ("completed", "failed", "cancelled")})
    delta["inflight_after"] = after["inflight"]
    return delta


def run_soak(spec: SoakSpec) -> SoakReport:
    models = list(spec.models)
    if not models:
        status, body = _get_json(spec.url + "/v1/models", spec.api_key)
        if status != 200 or not body:
            raise RuntimeError(f"soak: GET {spec.url}/v1/models answered {status}; give --models")
        models = [m["id"] for m in body["data"]]
    before = _admission(spec.url)
    samples, wall = asyncio.run(Soaker(spec, models).run())
    return summarize(samples, spec.duration_s, spec.window_s, wall, server_delta(before, _admission(spec.url)))


def render(report: SoakReport) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    lines = [f"soak: {report.sent} requests in {report.duration_s:.0f} s, {report.ok} ok, "
             f"{report.sent - report.ok} errors",
             "errors by code: " + (", ".join(f"{k}: {v}" for k, v in report.errors.items()) or "none"),
             "window  start_s  requests  errors  fanout p50/p95 ms  completion p50/p95 ms"]
    for w in report.windows:
        lines.append(f"{w.index:>6}  {w.start_s:>7.0f}  {w.requests:>8}  {w.errors:>6}  "
                     f"{f(w.p50_s['fanout']):>8}/{f(w.p95_s['fanout']):<8}  "
                     f"{f(w.p50_s['completion']):>10}/{f(w.p95_s['completion'])}")
    lines.append("p95 drift (last/first window): " + ", ".join(
        f"{k} {'-' if v is None else f'{v:.2f}x'}" for k, v in report.p95_drift.items()))
    if report.server is not None:
        lines.append("server accounting: " + ", ".join(f"{k} {v}" for k, v in report.server.items()))
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=4, help="users sending back to back")
    parser.add_argument("--window", type=float, default=60.0, help="seconds per latency window")
    parser.add_argument("--models", default="", help="comma-separated decoders (default: all of /v1/models)")
    parser.add_argument("--fanout", type=int, default=2, help="agents per fan-out request")
    parser.add_argument("--fanout-share", type=float, default=0.5, help="fraction of requests that are fan-outs")
    parser.add_argument("--records", type=int, default=6, help="key:value lines per context")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--api-key", default=os.environ.get("PREFILLSHARE_API_KEY"),
                        help="Bearer key (default: $PREFILLSHARE_API_KEY)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report as JSON to this file")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        spec = SoakSpec(url=args.url.rstrip("/"), duration_s=args.duration, concurrency=args.concurrency,
                        window_s=args.window, models=tuple(m for m in args.models.split(",") if m),
                        fanout=args.fanout, fanout_share=args.fanout_share, records=args.records,
                        max_tokens=args.max_tokens, timeout_s=args.timeout, api_key=args.api_key, seed=args.seed)
        report = run_soak(spec)
    except (ValueError, RuntimeError) as e:
        print(f"python -m bench soak: {e}", file=sys.stderr)
        return 2
    print(render(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(asdict(report), fh, indent=1)
    return 0 if report.ok == report.sent else 1
