"""`python -m bench overload`: open-loop traffic at a multiple of the app's saturation, with faults.

What a production service must show and a closed-loop soak cannot: behaviour over minutes
while more work arrives than it can do, with replicas dying under it. The run has two phases:

1. **Search** (skipped with ``--rate``): open-loop arrivals at doubling rates, a short step
   each, until the app completes clearly less than it is offered. The saturation rate is the
   best completed rate seen.
2. **Overload**: Poisson arrivals at ``overload x saturation`` for ``duration_s``. The mix:
   fan-outs and completions, streaming and not; some clients disconnect mid-stream; some
   send bad input. Faults (bench/faults.py) fire at the times given.

Every answer is classified (:func:`classify`): a complete answer; ``shed`` (429 with
Retry-After: admission said no, nothing ran; or 503 ``decoder_unavailable`` with Retry-After:
refused before admission because a decoder it names is restarting); a typed error (its code); a deliberate
disconnect; the right 4xx for bad input; or **lost** (a reset connection, a timeout, a
stream that ended without its end marker, an error without the app's JSON shape). The
report (:mod:`bench.overload_report`) checks the promises: nothing lost, 429s only with
Retry-After, recovery after each fault, no drift, no leaks, and the server's own accounting.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.faults import FaultError, FaultSpec, inject
from bench.soak import _QUESTIONS, _context

# Bodies the app must refuse with a 4xx naming the problem (never reaching an engine).
BAD_BODIES: tuple[tuple[str, bytes], ...] = (
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": -3}'),
    ("/v1/completions", b'{"model": "no-such-model", "prompt": "x"}'),
    ("/v1/chat/completions", b'{"model": "MODEL", "messages": "not a list"}'),
    ("/v1/agents/run", b'{"context": "c", "agents": [{"name": "a", "model": "MODEL", "temprature": 0}]}'),
    ("/v1/completions", b'{"model": "MODEL", "prompt": '),
)


@dataclass(frozen=True)
class Mix:
    """What each arrival is; shares are fractions of all arrivals."""

    fanout_share: float = 0.4
    stream_share: float = 0.5
    disconnect_share: float = 0.05  # of streaming requests: close after the first event
    bad_share: float = 0.05
    fanout: int = 2
    records: int = 6
    contexts: int = 8
    max_tokens: int = 8

    def __post_init__(self) -> None:
        for name in ("fanout_share", "stream_share", "disconnect_share", "bad_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"overload {name} must be in [0, 1]")
        for name in ("fanout", "records", "contexts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"overload {name} must be >= 1")


@dataclass(frozen=True)
class OverloadSpec:
    url: str
    app: str = "prefillshare"  # the Serve application's name (for faults)
    duration_s: float = 600.0
    overload: float = 2.0  # arrival rate as a multiple of the saturation rate
    rate: float | None = None  # fixed arrival rate (requests/s): skips the search
    search_start: float = 0.25
    search_step_s: float = 20.0
    search_max_steps: int = 8
    window_s: float = 10.0
    drain_s: float = 60.0  # after the last arrival: how long answers may still come
    timeout_s: float = 180.0
    sample_s: float = 2.0  # memory sampler period
    max_outstanding: int = 256  # requests in flight from this client at most (more: recorded not_sent)
    settle_s: float = 40.0  # after the drain, before the last sample: longer than the pool's lease_timeout_s
    faults: tuple[FaultSpec, ...] = ()
    admission_target_s: float | None = None  # the app's limits.admission_target_s: judged per minute
    models: tuple[str, ...] = ()
    api_key: str | None = None
    mix: Mix = field(default_factory=Mix)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_outstanding < 1:
            raise ValueError("overload max_outstanding must be >= 1")
        for name in ("duration_s", "overload", "search_start", "search_step_s", "window_s", "timeout_s", "sample_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"overload {name} must be > 0")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("overload rate must be > 0")
        late = [f.label for f in self.faults if f.at_s >= self.duration_s]
        if late:
            raise ValueError(f"overload faults after the run's end ({self.duration_s:g} s): {late}")


@dataclass(frozen=True)
class Sample:
    kind: str  # fanout | completion | bad
    stream: bool
    sent_s: float  # since the overload phase started
    latency_s: float
    outcome: str  # ok | shed | disconnected | bad_input_ok | not_sent | error <code> | lost <why> | bad_input_wrong <status>
    lag_s: float = 0.0  # how late the generator sent it (its own CPU share, not the app's doing)


def _error_code(raw: bytes) -> str | None:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("code") or err.get("type"))
    except Exception:  # noqa: BLE001 - not the app's error shape
        return None


def _agent_failure(results: list[dict]) -> str | None:
    for r in results:
        if r.get("error"):
            return str(r.get("code") or str(r["error"]).split(":")[0])
    return None


def classify_response(kind: str, status: int, headers, raw: bytes, n_agents: int) -> str:
    """The outcome of a non-streaming answer."""
    if kind == "bad":
        ok = 400 <= status < 500 and status != 429 and _error_code(raw) is not None
        return "bad_input_ok" if ok else f"bad_input_wrong {status}"
    if status == 429:
        return "shed" if headers.get("retry-after") else "lost 429 without Retry-After"
    code = _error_code(raw) if status != 200 else None
    if status == 503 and code == "decoder_unavailable":  # refused before admission: its decoder restarts
        return "shed" if headers.get("retry-after") else "lost 503 without Retry-After"
    if status != 200:
        return f"error {code}" if code else f"lost {status} without an error body"
    try:
        body = json.loads(raw)
    except ValueError:
        return "lost 200 without JSON"
    if kind == "fanout":
        results = body.get("results", [])
        failed = _agent_failure(results)
        if failed:
            return f"error {failed}"
        return "ok" if len(results) == n_agents else "lost agent missing"
    return "ok" if body.get("choices") else "lost no choices"


def classify_events(kind: str, events: list[dict], done: bool) -> str:
    """The outcome of a stream that answered 200: its events, and whether [DONE] came."""
    for ev in events:
        if "error" in ev:
            return f"error {ev['error'].get('code') or ev['error'].get('type')}"
        if kind == "fanout":
            results = ev["results"] if isinstance(ev.get("results"), list) else [ev]
            failed = _agent_failure([r for r in results if isinstance(r, dict)])
            if failed:
                return f"error {failed}"
    if not done:
        return "lost stream ended without [DONE]"
    return "ok" if events else "lost empty stream"


class Traffic:
    """Builds arrivals and sends them; one shared HTTP client."""

    def __init__(self, spec: OverloadSpec, models: list[str]):
        self.spec, self.mix, self.models = spec, spec.mix, models
        self.headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        self.contexts = [_context(spec.seed * 1000 + i, self.mix.records) for i in range(self.mix.contexts)]

    def arrival(self, rng: random.Random) -> tuple[str, bool, bool, str, bytes, int]:
        """(kind, stream, disconnect, path, body, agents) of one arrival."""
        m = self.mix
        if rng.random() < m.bad_share:
            path, body = rng.choice(BAD_BODIES)
            return "bad", False, False, path, body.replace(b"MODEL", rng.choice(self.models).encode()), 0
        stream = rng.random() < m.stream_share
        disconnect = stream and rng.random() < m.disconnect_share
        ctx = rng.choice(self.contexts)
        if rng.random() < m.fanout_share:
            agents = [{"name": f"a{i}", "model": rng.choice(self.models), "instruction": rng.choice(_QUESTIONS),
                       "max_tokens": m.max_tokens, "temperature": 0} for i in range(m.fanout)]
            body = {"context": ctx, "agents": agents, "stream": stream}
            return "fanout", stream, disconnect, "/v1/agents/run", json.dumps(body).encode(), m.fanout
        body = {"model": rng.choice(self.models), "prompt": f"{ctx}\nQ: {rng.choice(_QUESTIONS)}\nA:",
                "max_tokens": m.max_tokens, "temperature": 0, "stream": stream}
        return "completion", stream, disconnect, "/v1/completions", json.dumps(body).encode(), 1

    async def send(self, client, t0: float, arrival, due_s: float = 0.0) -> Sample:
        """``due_s``: when the arrival was due (since ``t0``); how late it was sent is the
        generator's lag, reported apart from the app's latency (which counts from the send)."""
        kind, stream, disconnect, path, body, n_agents = arrival
        sent = time.perf_counter()
        # the moment the client sends, as a front proxy would stamp it (the app's
        # limits.request_start_header): admission then judges the wait before the Router too
        headers = {**self.headers, "Content-Type": "application/json", "X-Request-Start": f"t={time.time():.6f}"}
        try:
            if stream:
                outcome = await self._stream(client, kind, path, body, headers, disconnect, n_agents)
            else:
                r = await client.post(self.spec.url + path, content=body, headers=headers)
                outcome = classify_response(kind, r.status_code, r.headers, r.content, n_agents)
        except Exception as e:  # noqa: BLE001 - a failed request is a data point
            outcome = f"lost {type(e).__name__}"
        return Sample(kind, stream, sent - t0, time.perf_counter() - sent, outcome, max(0.0, sent - t0 - due_s))

    async def _stream(self, client, kind, path, body, headers, disconnect, n_agents) -> str:
        async with client.stream("POST", self.spec.url + path, content=body, headers=headers) as r:
            if r.status_code != 200:
                return classify_response(kind, r.status_code, r.headers, await r.aread(), n_agents)
            events, done = [], False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                events.append(json.loads(data))
                if disconnect:
                    return "disconnected"  # leaving the block closes the connection mid-stream
            return classify_events(kind, events, done)


async def open_loop(traffic: Traffic, rate: float | Callable[[float], float], duration_s: float, seed: int,
                    on_tick=None) -> tuple[list[Sample], float]:
    """Poisson arrivals at ``rate``/s (or ``rate(t)``/s at ``t`` s, a schedule) for ``duration_s``; waits for every answer (bounded by
    the client timeout). ``on_tick(elapsed_s)`` runs once a second on its own task (faults fire
    there). At most ``spec.max_outstanding`` requests are in flight from this client: an arrival
    beyond that is recorded as ``not_sent`` (the client, not the app, would be the bottleneck:
    an HTTP pool with thousands of queued requests spends its CPU finding them a connection)."""
    import httpx

    rng = random.Random(seed)
    cap = traffic.spec.max_outstanding
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    async with httpx.AsyncClient(timeout=traffic.spec.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task] = []
        skipped: list[Sample] = []
        outstanding = 0
        done = asyncio.Event()

        async def one(arrival, due_s: float) -> Sample:
            nonlocal outstanding
            try:
                return await traffic.send(client, t0, arrival, due_s)
            finally:
                outstanding -= 1

        async def ticker() -> None:
            while not done.is_set():
                on_tick(time.perf_counter() - t0)
                try:
                    await asyncio.wait_for(done.wait(), 1.0)
                except TimeoutError:
                    pass

        tick = asyncio.create_task(ticker()) if on_tick is not None else None
        rate_at = rate if callable(rate) else (lambda _t: rate)
        next_at = rng.expovariate(rate_at(0.0))
        while next_at < duration_s:
            delay = t0 + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            arrival = traffic.arrival(rng)
            if outstanding >= cap:
                skipped.append(Sample(arrival[0], arrival[1], next_at, 0.0, "not_sent"))
            else:
                outstanding += 1
                tasks.append(asyncio.create_task(one(arrival, next_at)))
            next_at += rng.expovariate(rate_at(next_at))
        samples = list(await asyncio.gather(*tasks)) + skipped
        done.set()
        if tick is not None:
            await tick
        return samples, time.perf_counter() - t0


def completed_rate(samples: list[Sample], duration_s: float) -> float:
    """Complete answers per second that came back within the ``duration_s`` of arrivals (bad
    input and deliberate disconnects excluded). Answers that finish after it are the queue
    draining, not throughput: counting them (as the search once did) read 28.75/s at 32/s offered
    on a box that then completed ~10/s under load."""
    return sum(1 for s in samples if s.outcome == "ok" and s.sent_s + s.latency_s <= duration_s) / duration_s


def find_saturation(traffic: Traffic, spec: OverloadSpec, log=print) -> tuple[float, list[dict]]:
    """The best completed rate over doubling offered rates (stops once the app clearly falls behind)."""
    steps, rate = [], spec.search_start
    for i in range(spec.search_max_steps):
        samples, _ = asyncio.run(open_loop(traffic, rate, spec.search_step_s, spec.seed + 101 * i))
        done = completed_rate(samples, spec.search_step_s)
        real = sum(1 for s in samples if s.kind != "bad" and s.outcome != "not_sent") / spec.search_step_s
        steps.append({"offered_per_s": rate, "sent_per_s": real, "completed_per_s": done,
                      "shed": sum(1 for s in samples if s.outcome == "shed")})
        log(f"search: offered {rate:.2f}/s, completed {done:.2f}/s")
        if real > 0 and done < 0.8 * real:
            break
        rate *= 2
    return max(s["completed_per_s"] for s in steps), steps


class Sampler:
    """Samples memory and the pool's gauges every ``period_s`` on a thread, until stopped."""

    def __init__(self, url: str, app: str, period_s: float):
        self.url, self.app, self.period_s = url, app, period_s
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self, t0: float) -> Sampler:
        self._t0 = t0
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.rows

    def _loop(self) -> None:
        cpu = CpuByRole(self.app)
        while not self._stop.is_set():
            procs = processes()  # one scan of the process table feeds both
            self.rows.append({"t_s": time.perf_counter() - self._t0, **memory_now(self.app, procs),
                              **app_gauges(self.url), "cpu_s": cpu.sample(procs)})
            self._stop.wait(self.period_s)


def processes() -> list[dict]:
    """This machine's processes, each psutil's ``info`` (pid, ppid, name, create time, CPU times,
    memory) with its ``title``: its command line as Ray and vLLM set it, else its name."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "name", "create_time", "cpu_times", "memory_info"]):
        info = p.info
        out.append({**info, "title": " ".join(info["cmdline"] or ()) or (info["name"] or "")})
    return out


def role_of(title: str, app: str, parent: str | None) -> str:
    """Who a process is, from its title: a Serve deployment of the app (``Router``, ``Prefill-base``),
    an engine (``engine:<its replica's deployment>``), Serve's ``proxy`` / ``controller``, the rest of
    Ray by program (``ray:raylet``, ``ray:agent.py``, ``ray:IDLE``), anything else ``other:<program>``."""
    mark = f"ServeReplica:{app}:"
    if mark in title:
        return title.split(mark, 1)[1].split()[0].split(".")[0]
    if "VLLM::" in title or "EngineCore" in title or (parent and mark in parent):
        # an engine core, also one not yet (or never) renamed: a replica's child is its engine
        return "engine:" + (role_of(parent, app, None) if parent else "?")
    if "ProxyActor" in title:
        return "proxy"
    if "ServeController" in title:
        return "controller"
    words = title.split()
    if not words:
        return "other"
    if words[0].startswith("ray::"):  # a Ray worker: ray::IDLE, another app's replica, an actor
        return "ray:" + words[0][5:].split(":")[0]
    # a binary (raylet, gcs_server) or a script (ray's dashboard/agent.py, log_monitor.py, the serve CLI)
    script = next((w for w in words[1:] if not w.startswith("-") and "/" in w), None) if "python" in words[0] else None
    name = (script or words[0]).rsplit("/", 1)[-1]
    where = script or words[0]
    return ("ray:" if "/ray/" in where or name in ("raylet", "gcs_server", "serve", "ray") else "other:") + name


class CpuByRole:
    """CPU seconds each role (:func:`role_of`) has spent since the first sample, summed over its
    processes; a process that ends between samples keeps what it was last seen to have spent, one
    that started counts from zero. The generator's own process is ``generator``."""

    def __init__(self, app: str):
        self.app = app
        self._seen: dict[tuple[int, float], tuple[str, float]] = {}  # (pid, create time) -> (role, cpu at last sample)
        self.total: dict[str, float] = {}
        self._first = True

    def sample(self, procs: list[dict] | None = None) -> dict[str, float]:
        """Totals so far, from ``procs`` (:func:`processes`; default: scanned now)."""
        procs = processes() if procs is None else procs
        titles = {info["pid"]: info["title"] for info in procs}
        me = os.getpid()
        for info in procs:
            if info["cpu_times"] is None:
                continue
            key = (info["pid"], info["create_time"])
            spent = info["cpu_times"].user + info["cpu_times"].system
            if key in self._seen:
                role, before = self._seen[key]
            else:
                role = "generator" if info["pid"] == me else role_of(titles[info["pid"]], self.app,
                                                                       titles.get(info["ppid"]))
                before = spent if self._first else 0.0
            self.total[role] = self.total.get(role, 0.0) + spent - before
            self._seen[key] = (role, spent)
        self._first = False
        return dict(self.total)


def memory_now(app: str, procs: list[dict] | None = None) -> dict:
    """RSS of the app's replica and engine processes on this machine (from ``procs``, :func:`processes`;
    default: scanned now), and /dev/shm in use."""
    replicas = engines = 0
    for info in processes() if procs is None else procs:
        rss = info["memory_info"].rss if info["memory_info"] else 0
        if f"ServeReplica:{app}:" in info["title"]:
            replicas += rss
        elif "VLLM::" in info["title"] or "EngineCore" in (info["name"] or ""):
            engines += rss
    st = os.statvfs("/dev/shm")
    return {"replica_rss_bytes": replicas, "engine_rss_bytes": engines,
            "dev_shm_used_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize}


_GAUGES = {"prefillshare_kv_pool_pinned_blocks": "pinned_blocks", "prefillshare_kv_pool_held_bytes": "held_bytes",
           "prefillshare_kv_pool_blocks": "blocks", "prefillshare_admission_limit": "admission_limit"}


def app_gauges(url: str) -> dict:
    """The pools' gauges (summed over nodes) and the Routers' admission bound (summed over
    replicas) from the app's /metrics; empty when the app does not answer."""
    import httpx

    from bench.report import metric_sum, parse_metrics

    try:
        m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    except Exception:  # noqa: BLE001 - a sample missed while a replica restarts
        return {}
    present = {n for n, _ in m}
    out: dict = {key: metric_sum(m, name) for name, key in _GAUGES.items() if name in present}
    for name, key in (("prefillshare_deployment_replicas", "replicas"), ("prefillshare_deployment_target_replicas",
                                                                          "targets")):
        per = {dict(labels)["deployment"]: v for (n, labels), v in m.items() if n == name}
        if per:  # per deployment, as the controller reports them: running replicas, the autoscaler's target
            out[key] = per
    return out


def fallbacks(url: str) -> dict[str, float] | None:
    """``prefillshare_fallbacks_total`` by reason from the app's /metrics (None if it does not
    answer): the retries where safe (``decoder_retry``, ``router_retry``) and the private prefills."""
    import httpx

    from bench.report import parse_metrics

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except Exception:  # noqa: BLE001 - reported as not sampled
        return None
    out: dict[str, float] = {}
    for (name, labels), value in parse_metrics(text).items():
        if name == "prefillshare_fallbacks_total":
            reason = dict(labels)["reason"]
            out[reason] = out.get(reason, 0.0) + value
    return out


def admission(url: str) -> dict | None:
    import httpx

    try:
        return httpx.get(url + "/ready", timeout=30).json().get("admission")
    except Exception:  # noqa: BLE001
        return None


def models_of(spec: OverloadSpec) -> list[str]:
    if spec.models:
        return list(spec.models)
    import httpx

    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    r = httpx.get(spec.url + "/v1/models", headers=headers, timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"overload: GET {spec.url}/v1/models answered {r.status_code}; give --models")
    return [m["id"] for m in r.json()["data"]]


class FaultClock:
    """Fires each fault once its time has come; records when and on which PID."""

    def __init__(self, spec: OverloadSpec, log=print):
        self.pending = sorted(spec.faults, key=lambda f: f.at_s)
        self.app, self.log = spec.app, log
        self.fired: list[dict] = []

    def __call__(self, elapsed_s: float) -> None:
        while self.pending and self.pending[0].at_s <= elapsed_s:
            f = self.pending.pop(0)
            try:
                pid, err = inject(f, self.app), None
            except (FaultError, OSError) as e:
                pid, err = None, str(e)
            self.fired.append({"at_s": elapsed_s, "kind": f.kind, "deployment": f.deployment,
                               "hold_s": f.hold_s, "label": f.label, "pid": pid, "error": err})
            self.log(f"fault at {elapsed_s:.0f} s: {f.label} (pid {pid})" + (f": {err}" if err else ""))


def run(spec: OverloadSpec, log=print) -> dict:
    """Search (unless a rate is given), then the overload phase; the raw run as a dict."""
    traffic = Traffic(spec, models_of(spec))
    search: list[dict] = []
    if spec.rate is None:
        saturation, search = find_saturation(traffic, spec, log)
        rate = spec.overload * saturation
    else:  # the search's first step as a warm-up: a cold app's first answers are not the overload's
        saturation, rate = None, spec.rate
        warm, _ = asyncio.run(open_loop(traffic, spec.search_start, spec.search_step_s, spec.seed + 7))
        log(f"warm-up: {sum(1 for s in warm if s.outcome == 'ok')} answers at {spec.search_start:g}/s")
    log(f"overload: {rate:.2f} arrivals/s for {spec.duration_s:.0f} s")
    before, fallbacks_before = admission(spec.url), fallbacks(spec.url)
    t0 = time.perf_counter()
    cpu0, machine0 = time.process_time(), _machine_busy_s()
    sampler = Sampler(spec.url, spec.app, spec.sample_s).start(t0)
    clock = FaultClock(spec, log)
    samples, wall = asyncio.run(open_loop(traffic, rate, spec.duration_s, spec.seed, clock))
    client = {"cpu_s": time.process_time() - cpu0, "machine_busy_cpu_s": _machine_busy_s() - machine0,
              "wall_s": time.perf_counter() - t0, "cores": os.cpu_count()}
    drain_until = time.perf_counter() + spec.drain_s
    while time.perf_counter() < drain_until:  # let pins and leases expire, the pool settle
        after = admission(spec.url)
        if after and after.get("inflight") == 0:
            break
        time.sleep(2)
    time.sleep(spec.settle_s)  # fan-out pins whose decoders never came expire after the pool's lease
    mem = sampler.stop()
    mem.append({"t_s": time.perf_counter() - t0, **memory_now(spec.app), **app_gauges(spec.url)})
    return {"spec": _spec_dict(spec), "saturation_per_s": saturation, "rate_per_s": rate, "search": search,
            "wall_s": wall, "samples": [s.__dict__ for s in samples], "memory": mem, "faults": clock.fired,
            "client": client,
            "server_before": before, "server_after": admission(spec.url),
            "fallbacks_before": fallbacks_before, "fallbacks_after": fallbacks(spec.url)}


def _machine_busy_s() -> float:
    """CPU seconds this machine has spent busy (every process, every core), for the generator's share."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _spec_dict(spec: OverloadSpec) -> dict:
    d = {k: getattr(spec, k) for k in ("url", "app", "duration_s", "overload", "rate", "window_s", "seed",
                                        "admission_target_s")}
    d["mix"] = spec.mix.__dict__
    d["faults"] = [f.label + f" at {f.at_s:g}s" for f in spec.faults]
    return d


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--app", default="prefillshare", help="the Serve application's name (faults find replicas by it)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of overload")
    parser.add_argument("--overload", type=float, default=2.0, help="arrival rate as a multiple of saturation")
    parser.add_argument("--rate", type=float, default=None, help="fixed arrivals/s (skips the saturation search)")
    parser.add_argument("--search-start", type=float, default=0.25, help="first offered rate of the search, /s")
    parser.add_argument("--search-step", type=float, default=20.0, help="seconds per search step")
    parser.add_argument("--fault", action="append", default=[], metavar="AT:KIND:DEPLOYMENT[:SECONDS]",
                        help="e.g. 120:kill:Decode-lookup, 300:stall:Prefill-base:20, 400:stall:side/Sidecar:20 "
                        "(another application's deployment as APP/DEPLOYMENT; repeatable)")
    parser.add_argument("--target", type=float, default=None,
                        help="the app's limits.admission_target_s: the report judges each minute's p95 against it")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per report window")
    parser.add_argument("--drain", type=float, default=60.0, help="max seconds to wait for answers after the end")
    parser.add_argument("--settle", type=float, default=40.0,
                        help="seconds after the drain before the last sample (longer than pool.lease_timeout_s)")
    parser.add_argument("--max-outstanding", type=int, default=256,
                        help="requests in flight from this client at most; arrivals beyond are recorded not_sent")
    parser.add_argument("--models", default="", help="comma-separated decoders (default: all of /v1/models)")
    parser.add_argument("--fanout-share", type=float, default=0.4)
    parser.add_argument("--stream-share", type=float, default=0.5)
    parser.add_argument("--disconnect-share", type=float, default=0.05)
    parser.add_argument("--bad-share", type=float, default=0.05)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--api-key", default=os.environ.get("PREFILLSHARE_API_KEY"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/overload", help="folder for overload.json, overload.md and the plot")
    parser.set_defaults(func=_main)


def spec_from_args(args: argparse.Namespace) -> OverloadSpec:
    mix = Mix(fanout_share=args.fanout_share, stream_share=args.stream_share,
              disconnect_share=args.disconnect_share, bad_share=args.bad_share, max_tokens=args.max_tokens)
    return OverloadSpec(url=args.url.rstrip("/"), app=args.app, duration_s=args.duration, overload=args.overload,
                        rate=args.rate, search_start=args.search_start, search_step_s=args.search_step,
                        window_s=args.window, drain_s=args.drain, max_outstanding=args.max_outstanding,
                        settle_s=args.settle, faults=tuple(FaultSpec.parse(f) for f in args.fault),
                        admission_target_s=args.target,
                        models=tuple(m for m in args.models.split(",") if m), api_key=args.api_key, mix=mix,
                        seed=args.seed)


def _main(args: argparse.Namespace) -> int:
    from bench.overload_report import summarize, write

    try:
        spec = spec_from_args(args)
        raw = run(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, RuntimeError) as e:
        print(f"python -m bench overload: {e}", file=sys.stderr)
        return 2
    report = summarize(raw)
    text = write(raw, report, Path(args.out))
    print(text)
    return 0 if report["promises"]["nothing_lost"] else 1
