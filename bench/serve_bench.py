"""`python -m bench serve`: PrefillShare vs per-model P/D vs colocated (full or LoRA decoders), one HTTP door.

The driver is the project's client (sessions of ``/v1/agents/run``, bench/client.py) or vLLM's
own benchmark client (``--driver vllm``: N independent ``/v1/completions`` over one shared prefix,
bench/vllm_client.py), which also drives stock vLLM servers as systems (bench/stock_vllm.py),
or agents as frameworks define them (``--driver chat``: N streamed ``/v1/chat/completions`` per
session, each ``[system: the agent's own 200-500-token prompt, user: the shared context]`` with its
own tools; the app's chat decoders shared-first and system-first against stock vLLM).

One Ray cluster, one Serve HTTP proxy; the systems (bench/systems.py) are deployed one
after another as the same Serve application with different configs, so every system runs on
the same machine in the same run and answers the same seeded sessions. Per system:
  1. deploy, wait for /ready, one warm-up session;
  2. per context length, unloaded phase costs (one request at a time) for the work bound;
  3. per (N, L, R), repeat and load point, sessions at Poisson rate lambda (or fixed concurrency);
     /metrics is read before and after (prefill tokens, cache hits, pool bytes), CPU seconds of
     every process of the cluster are summed;
  4. the application is deleted (its engines exit) before the next system starts.
Then: Markdown + JSON + PNG plots, ratios beside the bound (bench/report.py).

Inside a loopback-only namespace (Ray listens on every interface):
  unshare -n bash -c 'ip link set lo up; RAY_AUTH_MODE=disabled python -m bench serve --quick'
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.local_cluster import free_port
from bench.models import SHAPES, SMALL, ModelShape
from bench.stock_vllm import STOCK_SYSTEMS
from bench.systems import CHAT_SYSTEMS, SYSTEMS, Topology, decoder_names
from bench.workload import WorkloadSpec

PROJECT = Path(__file__).resolve().parents[1]
GIB_PER_ENGINE = 1.4  # beyond its KV space (docs/platform.md)


@dataclass(frozen=True)
class ServeBenchConfig:
    systems: tuple[str, ...] = ("a", "b", "c")  # and/or a-lora, b-lora, c-lora
    fanouts: tuple[int, ...] = (2,)
    lengths: tuple[int, ...] = (1024,)
    rounds: tuple[int, ...] = (1,)
    output_tokens: int = 32
    rates: tuple[float, ...] = (0.05, 0.1, 0.2)
    concurrency: tuple[int, ...] = ()      # closed loop instead of rates when given
    duration_s: float = 40.0               # arrivals (or closed-loop sending) per point
    max_sessions: int = 200
    session_timeout_s: float = 300.0
    warmup: int = 4                        # warm-up sessions per system, sent together
    repeats: int = 1                       # runs of every load point (fresh sessions each), for the spread
    probes: int = 2
    seed: int = 0
    models: str = "random"                 # "random" | "shipped"
    shape: ModelShape = ModelShape()
    topology: Topology = Topology()
    max_engines: int = 8
    slo_s: float | None = None             # default: slo_factor x the baseline's (b, c-lora, v-lora) lowest-load p95
    slo_factor: float = 2.0
    out: str = "runs/bench/serve"
    model_dir: str = "runs/bench/serve-models"
    tokenizer: str = "checkpoints/tokenizer"
    checkpoints: str = "checkpoints"
    ready_timeout_s: float = 900.0
    driver: str = "project"                # "project" (sessions of /v1/agents/run) | "vllm" (vLLM's client) | "chat"
    system_tokens: tuple[int, int] = (200, 500)  # --driver chat: each agent's system prompt, min and max tokens
    agent_tools: int = 2                   # --driver chat: tools of each agent

    def __post_init__(self) -> None:
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad or not self.systems:
            raise ValueError(f"--systems: unknown {bad} (choose from {','.join(SYSTEMS)})")
        if not self.fanouts or min(self.fanouts) < 1:
            raise ValueError("--fanouts: give fan-outs >= 1")
        if not self.rates and not self.concurrency:
            raise ValueError("--rates or --concurrency: give at least one load point")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("--concurrency: values must be >= 1")
        if self.models not in ("random", "shipped"):
            raise ValueError("--models: 'random' or 'shipped'")
        if self.duration_s <= 0:
            raise ValueError("--duration must be > 0 seconds")
        if self.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if self.driver not in ("project", "vllm", "chat"):
            raise ValueError("--driver: 'project', 'vllm' or 'chat'")
        if self.driver == "project" and any(s in STOCK_SYSTEMS for s in self.systems):
            raise ValueError("--systems: the stock vLLM servers (v-lora, v-one) have no /v1/agents/run; "
                             "drive them with --driver vllm or chat")
        if self.driver != "project" and self.rounds != (1,):
            raise ValueError(f"--driver {self.driver}: one round per session (one request per agent); --rounds 1")
        if self.driver == "chat" and any(s not in CHAT_SYSTEMS for s in self.systems):
            raise ValueError(f"--driver chat: systems {', '.join(CHAT_SYSTEMS)} (chat decoders that call tools, "
                             "stock vLLM servers)")
        if len(self.system_tokens) != 2 or not 1 <= self.system_tokens[0] <= self.system_tokens[1] \
                or self.agent_tools < 0:
            raise ValueError("--system-tokens MIN,MAX with 1 <= MIN <= MAX; --agent-tools >= 0")
        if self.models == "shipped" and any(s.endswith("-lora") or s in STOCK_SYSTEMS for s in self.systems):
            raise ValueError("--systems: the *-lora systems need --models random (random LoRA adapters of the base)")
        for L in self.lengths:
            WorkloadSpec(L, 1, self.output_tokens, 1)

    @property
    def mode(self) -> str:
        return "concurrency" if self.concurrency else "rate"

    @property
    def loads(self) -> tuple[float, ...]:
        return tuple(float(c) for c in self.concurrency) if self.concurrency else tuple(self.rates)

    def specs(self, n_max: int) -> list[WorkloadSpec]:
        return [WorkloadSpec(L, n, self.output_tokens, r) for n in self.fanouts if n <= n_max
                for L in self.lengths for r in self.rounds]


def _max_model_len(cfg: ServeBenchConfig, limit: int) -> int:
    """Room for the largest context, R rounds of joined outputs, instructions and O new tokens."""
    need = max(cfg.lengths) + max(cfg.rounds) * max(cfg.fanouts) * (cfg.output_tokens + 24) + 64
    if cfg.driver == "chat":  # an agent's own system prompt and tools line (~40 tokens a tool)
        need += cfg.system_tokens[1] + 64 * cfg.agent_tools
    need = int(math.ceil(need / cfg.topology.block_size) * cfg.topology.block_size)
    if need > limit:
        raise ValueError(f"--lengths/--rounds/--fanouts/--output-tokens: sessions need {need} tokens of context, "
                         f"the model allows {limit}")
    return need


# --- cluster helpers -----------------------------------------------------------------
def _cluster_cpu_s() -> float:
    """User + system CPU seconds of every process this driver started (Ray, replicas, engines)."""
    import psutil

    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def _get(url: str, timeout: float = 30.0) -> tuple[int, str]:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout)
        return r.status_code, r.text
    except httpx.HTTPError as e:
        return 0, f"{type(e).__name__}: {e}"


def _start_ray(tmp: str, log, attempts: int = 3) -> None:
    """ray.init, retried: on a saturated machine the raylet can miss Ray's fixed 30 s start window."""
    import ray

    for i in range(attempts):
        try:
            ray.init(num_cpus=32, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
                     runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                                               "PYTHONPATH": str(PROJECT)}})
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this timeout
            if i + 1 == attempts or "timed out during startup" not in str(e):
                raise
            log(f"ray.init failed ({e}); retrying")
            ray.shutdown()


def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        status, last = _get(url + "/ready", timeout=30)
        if status == 200:
            return
        time.sleep(3)
    raise RuntimeError(f"/ready not 200 after {timeout_s:.0f}s: {last[:500]}")


# The app's replicas send their metrics events in batches, every 0.5 s (deployments/metrics.py
# SEND_EVERY_S): a point's last events reach /metrics within that, so the closing scrape waits,
# and so does the opening one (else the warm-up's or the probes' last events land in the point).
METRICS_SETTLE_S = 1.5


def _metrics(url: str, stock: bool = False) -> dict:
    from bench.report import parse_metrics
    from bench.stock_vllm import as_prefillshare_counters

    status, text = _get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}: {text[:200]}")
    return as_prefillshare_counters(parse_metrics(text)) if stock else parse_metrics(text)


async def _sample_pool(url: str, stop: asyncio.Event, period_s: float = 1.0) -> tuple[float, float]:
    """Peaks of the pool's held bytes (every block, cached ones included) and of its pinned
    blocks (held for fan-out loads still to come) while a point runs."""
    import httpx

    from bench.report import metric_sum, parse_metrics

    held = pinned = 0.0
    async with httpx.AsyncClient(timeout=10) as c:
        while not stop.is_set():
            try:
                m = parse_metrics((await c.get(url + "/metrics")).text)
                held = max(held, metric_sum(m, "prefillshare_kv_pool_held_bytes"))
                pinned = max(pinned, metric_sum(m, "prefillshare_kv_pool_pinned_blocks"))
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except TimeoutError:
                pass
    return held, pinned


def _relative(value, root: Path):
    """``value`` with every path string under ``root`` made relative to it: results that do not
    name the machine they ran on."""
    if isinstance(value, dict):
        return {k: _relative(v, root) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_relative(v, root) for v in value]
    if isinstance(value, str) and value.startswith(str(root) + os.sep):
        return os.path.relpath(value, root)
    return value


# --- measuring one system ------------------------------------------------------------
def _probe_costs(url: str, cfg: ServeBenchConfig, maker, L: int, n: int, system_seed: int):
    """Unloaded phase costs at context length L (medians over cfg.probes repeats), one request
    at a time: first agent on a fresh context, next agent (another decoder) on the same
    context, and the decode time of O tokens."""
    import httpx

    from bench.client import run_session
    from bench.report import PhaseCosts
    from bench.workload import Session, make_sessions

    one, full = WorkloadSpec(L, 1, 1, 1), WorkloadSpec(L, 1, cfg.output_tokens, 1)
    other = ["agent1" if n > 1 else "agent0"]

    async def probe(k: int):
        async with httpx.AsyncClient(timeout=cfg.session_timeout_s) as c:
            s = make_sessions(one, 1, 10_000 + system_seed * 100 + k, maker)[0]
            r1 = await run_session(c, url, s, one, 0.0, cfg.session_timeout_s)
            s2 = Session(s.index, s.context, (s.instructions[0] + " again",))
            r2 = await run_session(c, url, s2, one, 0.0, cfg.session_timeout_s, models=other)
            d = make_sessions(full, 1, 20_000 + system_seed * 100 + k, maker)[0]
            r3 = await run_session(c, url, d, full, 0.0, cfg.session_timeout_s)
        return r1, r2, r3

    first, marginal, decode = [], [], []
    # one unrecorded round first: a replica's first requests pay one-off costs (seen: 40 s vs 1 s)
    for k in range(-1, max(1, cfg.probes)):
        r1, r2, r3 = asyncio.run(probe(k))
        if k < 0:
            continue
        if r1.ok:
            first.append(r1.agents[0].ttft_s)
        if r2.ok:
            marginal.append(r2.agents[0].ttft_s)
        if r3.ok:
            decode.append(r3.agents[0].e2e_s - r3.agents[0].ttft_s)
    if not (first and marginal and decode):
        return None
    return PhaseCosts(statistics.median(first), statistics.median(marginal), statistics.median(decode))


def _run_point(url: str, cfg: ServeBenchConfig, system: str, spec: WorkloadSpec, load: float, maker,
               kv_bytes_per_token: int, repeat: int = 0):
    from bench.client import closed_loop, open_loop
    from bench.report import summarize
    from bench.workload import make_sessions, poisson_arrivals

    # fresh contexts per load point (a context seen at an earlier point would hit prefix caches);
    # the same ones for every system
    seed = f"{cfg.seed}-{cfg.mode}-{load:g}" + (f"-r{repeat}" if repeat else "")
    if cfg.mode == "rate":
        arrivals = poisson_arrivals(load, cfg.duration_s, cfg.seed + repeat, cfg.max_sessions)
        count = len(arrivals)
    else:
        count = cfg.max_sessions
    stock = system in STOCK_SYSTEMS
    if not stock:
        time.sleep(METRICS_SETTLE_S)
    before, cpu0 = _metrics(url, stock), _cluster_cpu_s()

    async def go():
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_pool(url, stop))
        try:
            if cfg.driver == "vllm":
                from bench import vllm_client

                names = decoder_names(spec.fanout)
                argv = vllm_client.client_argv(url, spec, cfg.mode, load, count, cfg_tokenizer(cfg), names,
                                               cfg.seed * 1000 + repeat * 100 + int(load * 10))
                # in a thread: the client runs its own event loop
                result = await asyncio.to_thread(vllm_client.run_client, argv)
                return vllm_client.sessions_of(result, spec.fanout, names)
            sessions, send = make_sessions(spec, count, seed, maker), _chat_sender(cfg, spec.fanout, maker)
            if cfg.mode == "rate":
                return await open_loop(url, sessions, spec, arrivals, cfg.session_timeout_s, send)
            return await closed_loop(url, sessions, spec, int(load), cfg.duration_s, cfg.session_timeout_s, send)
        finally:
            stop.set()
            peak_box.append(await sampler)

    peak_box: list[tuple[float, float]] = []
    results, t0, t_end = asyncio.run(go())
    cpu = _cluster_cpu_s() - cpu0
    if not stock:
        time.sleep(METRICS_SETTLE_S)
    after = _metrics(url, stock)
    held, pinned_blocks = peak_box[0]
    pinned = pinned_blocks * cfg.topology.block_size * kv_bytes_per_token
    p = summarize(system, spec, cfg.mode, load, results, t0, t_end, before, after, held, pinned,
                  kv_bytes_per_token, cpu)
    return replace(p, repeat=repeat, loadavg=round(os.getloadavg()[0], 1))


def _chat_sender(cfg: ServeBenchConfig, n: int, maker):
    """How a session is sent with --driver chat: the N agents' chat completions (the agents' system
    prompts and tools seeded by --seed alone, so every system and point meets the same agents);
    None (the project's client) otherwise."""
    if cfg.driver != "chat":
        return None
    from functools import partial

    from bench.client import run_chat_session
    from bench.workload import agent_profiles

    profiles = agent_profiles(decoder_names(n), cfg.seed, maker, cfg.system_tokens, cfg.agent_tools)
    return partial(run_chat_session, profiles=profiles)


def cfg_tokenizer(cfg: ServeBenchConfig) -> str:
    return str((PROJECT / cfg.tokenizer).resolve()) if not os.path.isabs(cfg.tokenizer) else cfg.tokenizer


def _warm_up(url: str, cfg: ServeBenchConfig, system: str, n: int, maker, log) -> None:
    """Unrecorded sessions (fresh contexts), sent together so that every prefill replica gets some
    before the measurement; with the same driver as the points (a stock server has no agent route)."""
    from bench.client import open_loop
    from bench.workload import make_sessions

    spec = WorkloadSpec(min(cfg.lengths), n, cfg.output_tokens, 1)
    if cfg.driver == "vllm":
        from bench import vllm_client

        names = decoder_names(n)
        result = vllm_client.run_client(vllm_client.client_argv(
            url, spec, "concurrency", cfg.warmup, cfg.warmup, cfg_tokenizer(cfg), names, 90_000))
        res = vllm_client.sessions_of(result, n, names)[0]
    else:
        s = make_sessions(spec, cfg.warmup, 90_000, maker)
        res, _, _ = asyncio.run(open_loop(url, s, spec, [0.0] * len(s), cfg.session_timeout_s,
                                          _chat_sender(cfg, n, maker)))
    for r in res:
        if not r.ok:
            log(f"[{system}] warm-up session failed: {r.error or [a.error for a in r.agents]}")


def _deployable_n(cfg: ServeBenchConfig, system: str) -> int:
    """Largest fan-out of the sweep whose engines fit --max-engines."""
    fits = [n for n in cfg.fanouts if cfg.topology.engines(system, n) <= cfg.max_engines]
    return max(fits, default=0)


def _model_set(cfg: ServeBenchConfig, tokenizer: str):
    """(the models to serve, their max_position_embeddings)."""
    from bench import models as bm

    model_root = Path(cfg.model_dir) if os.path.isabs(cfg.model_dir) else PROJECT / cfg.model_dir
    n_max = max(cfg.fanouts)
    if cfg.models == "random":
        mset = bm.random_models(model_root, n_max, cfg.shape, tokenizer, cfg.topology.dtype, cfg.topology.lora_rank)
        return mset, cfg.shape.max_position
    mset = bm.shipped_models(model_root / "shipped", PROJECT / cfg.checkpoints, n_max, cfg.topology.dtype)
    return mset, json.loads((Path(mset.base) / "config.json").read_text())["max_position_embeddings"]


@contextlib.contextmanager
def _deployed(cfg: ServeBenchConfig, system: str, n: int, mset, topo, tokenizer: str, app_url: str):
    """The system's URL while it is up: the Serve app, or a stock vLLM server beside it."""
    if system in STOCK_SYSTEMS:
        from bench.stock_vllm import StockServer, server_argv

        argv = server_argv(system, mset.base, mset.adapters, n, topo, tokenizer, free_port(),
                           mset.chat_template if cfg.driver == "chat" else None)
        server = StockServer(argv, Path(cfg.out) / f"server-{system}.log", topo.threads_bind)
        try:
            server.wait_ready(cfg.ready_timeout_s)
            yield server.url
        finally:
            server.stop()
        return
    from ray import serve

    from bench.systems import app_config
    from prefillshare.app.config import load_config
    from prefillshare.deployments.application import build

    pool = f"/dev/shm/ps-bench-{os.getpid()}-{system}"
    app_cfg = load_config(app_config(system, mset, n, topo, tokenizer, pool))
    serve.run(build(app_cfg), name=f"bench-{system}", route_prefix="/", blocking=False)
    try:
        _wait_ready(app_url, cfg.ready_timeout_s)
        yield app_url
    finally:
        serve.delete(f"bench-{system}")
        shutil.rmtree(pool, ignore_errors=True)


def _measure(url: str, cfg: ServeBenchConfig, system: str, si: int, n: int, mset, maker, costs: dict,
             points: list, log) -> None:
    """One deployed system: warm-up, the bound's unloaded probes, then every point (appended to ``points``)."""
    if cfg.warmup:
        _warm_up(url, cfg, system, n, maker, log)
    for L in cfg.lengths if cfg.driver == "project" else ():  # the bound's probes are sessions
        c = _probe_costs(url, cfg, maker, L, n, si)
        if c is not None:
            costs.setdefault(L, {})[system] = c
            log(f"[{system}] L={L} unloaded: first {c.first_s:.3f}s next {c.marginal_s:.3f}s "
                f"decode {c.decode_s:.3f}s")
    for spec in cfg.specs(n):
        for rep_ in range(cfg.repeats):
            for load in cfg.loads:
                p = _run_point(url, cfg, system, spec, load, maker, mset.kv_bytes_per_token, rep_)
                points.append(p)
                log(f"[{system}] {spec.label} load {load:g} rep {rep_}: ok {p.ok}/{p.sent} fan-out "
                    f"p95 {p.fanout_latency['p95'] or float('nan'):.2f}s {p.sessions_per_s:.3f} "
                    f"sess/s {p.output_tok_per_s:.1f} tok/s load avg {p.loadavg}"
                    + (f" errors {p.errors[:2]}" if p.errors else ""))


def run(cfg: ServeBenchConfig, log=print) -> dict:
    """Measure every system; returns (and writes) the result document."""
    import ray
    from ray import serve

    from bench.workload import ContextMaker

    tokenizer = cfg_tokenizer(cfg)
    n_max = max(cfg.fanouts)
    mset, limit = _model_set(cfg, tokenizer)
    topo = replace(cfg.topology, max_model_len=_max_model_len(cfg, limit),
                   max_tokens_cap=max(cfg.topology.max_tokens_cap, cfg.output_tokens),
                   max_agents=max(cfg.topology.max_agents, n_max), max_rounds=max(cfg.topology.max_rounds, max(cfg.rounds)))
    log(f"models: {mset.description}; max_model_len {topo.max_model_len}")
    maker = ContextMaker(tokenizer)

    own_tmp = not os.environ.get("RAY_TMPDIR")  # made here: removed at the end (the results are in --out)
    tmp = os.environ.get("RAY_TMPDIR") or f"/tmp/ray-bench-{os.getpid()}"
    os.environ.setdefault("RAY_TMPDIR", tmp)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    on_serve = any(s not in STOCK_SYSTEMS for s in cfg.systems)
    if on_serve:
        _start_ray(tmp, log)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    app_url = f"http://127.0.0.1:{port}" if on_serve else ""
    points, costs, skipped, deploy_s = [], {}, [], {}

    try:
        for si, system in enumerate(cfg.systems):
            n = _deployable_n(cfg, system)
            too_big = [m for m in cfg.fanouts if m > n]
            if too_big:
                skipped.append(f"{system} {SYSTEMS[system]} N={too_big}: needs "
                               f"{[cfg.topology.engines(system, m) for m in too_big]} engines (~{GIB_PER_ENGINE} GiB "
                               f"+ {topo.kv_cache_gib} GiB KV each) > --max-engines {cfg.max_engines}")
                log("skip: " + skipped[-1])
            if n == 0:
                continue
            t0 = time.perf_counter()
            log(f"[{system} {SYSTEMS[system]}] deploying {topo.engines(system, n)} engines ...")
            try:
                with _deployed(cfg, system, n, mset, topo, tokenizer, app_url) as url:
                    deploy_s[system] = time.perf_counter() - t0
                    log(f"[{system}] ready in {deploy_s[system]:.0f}s")
                    _measure(url, cfg, system, si, n, mset, maker, costs, points, log)
            finally:
                if points:  # partial results survive an interrupted sweep
                    doc, comps = _document(cfg, mset, topo, deploy_s, skipped, costs, points)
                    write_outputs(doc, points, comps, costs, cfg.out, log=lambda *_: None)
    finally:
        if on_serve:
            serve.shutdown()
            ray.shutdown()
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    doc, comps = _document(cfg, mset, topo, deploy_s, skipped, costs, points)
    write_outputs(doc, points, comps, costs, cfg.out, log)
    return doc


def _document(cfg: ServeBenchConfig, mset, topo: Topology, deploy_s: dict, skipped: list, costs: dict,
              points: list) -> tuple[dict, list]:
    """The result document and the comparisons, from whatever has been measured so far."""
    from bench.report import compare_all

    n_max = max(cfg.fanouts)
    comps = []
    for spec in cfg.specs(n_max):
        pts = [p for p in points if p.label == spec.label]
        ref = next(([p for p in pts if p.system == s] for s in ("b", "c-lora", "v-lora") if any(
            p.system == s for p in pts)), pts)
        slo = cfg.slo_s
        if slo is None and ref:
            lowest = min(ref, key=lambda p: p.load)
            slo = cfg.slo_factor * lowest.fanout_latency["p95"] if lowest.fanout_latency["p95"] else None
        comps += compare_all(pts, costs.get(spec.context_tokens, {}), slo)
    doc = {
        "config": _jsonable(asdict(cfg)),
        "machine": _machine(),
        "models": _relative(mset.to_dict(), PROJECT),
        "topology": asdict(topo),
        "deploy_seconds": deploy_s,
        "skipped": skipped,
        "phase_costs": {str(L): {s: asdict(c) for s, c in per.items()} for L, per in costs.items()},
        "points": [p.to_dict() for p in points],
        "comparisons": [c.to_dict() for c in comps],
    }
    return doc, comps


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def _machine() -> dict:
    import platform

    load = os.getloadavg()
    mem = None
    try:
        import psutil

        mem = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return {"cpus": os.cpu_count(), "memory_gib": mem, "platform": platform.platform(),
            "loadavg_at_end": [round(x, 1) for x in load], "time_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


_DRIVERS = {"project": "the project's client (sessions of /v1/agents/run)",
            "vllm": "vLLM's benchmark client (vllm.benchmarks.serve, prefix_repetition in file order, the N decoders "
                    "as --lora-modules round-robin: N /v1/completions per shared prefix; no phase-cost probes, so "
                    "no phase bound)",
            "chat": "agents as frameworks send them (N streamed /v1/chat/completions per session, sent together: "
                    "[system: the agent's own prompt, user: the shared context] + the agent's tools; no phase-cost "
                    "probes, so no phase bound)"}


def render_markdown(doc: dict, points, comps, costs) -> str:
    from bench.report import agents_table, comparison_table, costs_table, points_table

    m, t = doc["machine"], doc["topology"]
    lines = [
        "# python -m bench serve",
        "",
        f"Machine: {m['cpus']} CPUs, {m['memory_gib']} GiB, load average at end {m['loadavg_at_end']} "
        f"({m['time_utc']} UTC). Models: {doc['models']['description']}. Engines: KV space "
        f"{t['kv_cache_gib']} GiB, block {t['block_size']}, threads {t['threads_bind']}, "
        f"max_model_len {t['max_model_len']}; systems a and a-lora use {t['prefill_replicas']} shared prefill "
        f"replica(s), i-lora {t.get('in_engine_replicas', t['prefill_replicas'])} replica(s) of its engine sharing the cores; LoRA: rank {t['lora_rank']}, c-lora runs {t['colocated_replicas']} replica(s) of its "
        f"multi-LoRA engine. Driver: {_DRIVERS[doc['config'].get('driver', 'project')]}. "
        f"Each load point ran {doc['config']['repeats']} time(s); a ratio whose spread over "
        "repeats includes 1.0 reads \"no measurable difference\".",
        "",
        "## Per load point",
        points_table(points),
        "",
        "## Ratios (PrefillShare vs baseline) beside the work bound",
        comparison_table(comps),
    ]
    if doc["config"].get("driver") == "chat":
        lines[4:4] = ["## Agents with their own system prompts", _agents_note(doc["config"]), "",
                      agents_table(points), ""]
    if costs:  # none in a run driven by vLLM's or the chat client
        lines += ["", "## Unloaded phase costs (bound inputs)", costs_table(costs)]
    if doc.get("merged_from"):
        lines[2:2] = [f"Runs drawn together: {', '.join(doc['merged_from'])} (machine, models and settings "
                      "below are the first run's; each comparison uses its own run's phase costs).", ""]
    if doc["skipped"]:
        lines += ["", "## Not run", *[f"- {s}" for s in doc["skipped"]]]
    return "\n".join(lines) + "\n"


def _agents_note(config: dict) -> str:
    lo, hi = config.get("system_tokens", (0, 0))
    return (f"Each agent: its own system prompt of {lo}-{hi} tokens and {config.get('agent_tools')} tools, the same "
            "in every session; the user turn is the session's shared context. Base prompt tokens: what the prefill "
            "stage computed per fan-out (the app's `prefillshare_prefill_tokens_computed_total{stage=\"prefill\"}`, "
            "a stock server's `vllm:prefix_cache_queries_total` minus `vllm:prefix_cache_hits_total`); "
            "ratios are this system's figure over a-sf-lora's at the same point.")


def rerender(results_json: str | Path | list, out: str | None = None, log=print) -> dict:
    """Tables and plots of saved runs, made again with this code (``--report``); nothing is measured.

    Each run's comparisons are recomputed from its own points and phase costs with the SLO it
    used. Several runs (e.g. N=2,4 and N=8 at one L) are drawn together: their points are pooled,
    and the costs table keeps, per L, the first run's probes."""
    from bench.report import Comparison, PhaseCosts, PointResult, compare_all

    paths = [Path(results_json)] if isinstance(results_json, str | Path) else [Path(p) for p in results_json]
    if len(paths) > 1 and out is None:
        raise SystemExit("--report with several runs: give --out")
    merged: dict | None = None
    points: list[PointResult] = []
    comps: list[Comparison] = []
    costs: dict[int, dict[str, PhaseCosts]] = {}
    for path in paths:
        try:
            doc = json.loads(path.read_text())
            pts = [PointResult(**p) for p in doc["points"]]
            run_costs = {int(L): {s: PhaseCosts(**c) for s, c in per.items()} for L, per in doc["phase_costs"].items()}
            slo = {c["label"]: c["slo_s"] for c in doc.get("comparisons", [])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--report: {path} is not a results.json of python -m bench serve ({e})") from None
        for key in sorted({p.key for p in pts}):
            group = [p for p in pts if p.key == key]
            comps += compare_all(group, run_costs.get(key[1], {}), slo.get(group[0].label))
        for L, per in run_costs.items():
            costs.setdefault(L, per)
        points += pts
        merged = merged or doc
    assert merged is not None
    merged = {**merged, "points": [p.to_dict() for p in points], "comparisons": [c.to_dict() for c in comps],
              "phase_costs": {str(L): {s: asdict(c) for s, c in per.items()} for L, per in costs.items()}}
    if len(paths) > 1:
        merged["merged_from"] = [str(p) for p in paths]
    if out is None:  # next to the JSON: its own folder, or one named after the file
        out = str(paths[0].parent if paths[0].name == "results.json" else paths[0].with_suffix(""))
    write_outputs(merged, points, comps, costs, out, log)
    return merged


def write_outputs(doc: dict, points, comps, costs, out: str, log=print) -> None:
    from bench.plots import agents_bars, p95_vs_load, throughput_vs_load, throughput_vs_n

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2))
    md = render_markdown(doc, points, comps, costs)
    (out_dir / "results.md").write_text(md)
    if points:
        title = f"{doc['models']['description']}; {doc['machine']['cpus']} CPUs"
        p95_vs_load(points, out_dir / "p95_vs_load.png", title)
        throughput_vs_n(points, out_dir / "throughput_vs_n.png", title)
        throughput_vs_load(points, out_dir / "throughput_vs_load.png", title)
        if doc["config"].get("driver") == "chat":
            agents_bars(points, out_dir / "agents.png", title)
    log(md)
    log(f"wrote {out_dir}/results.json, results.md, p95_vs_load.png, throughput_vs_n.png, throughput_vs_load.png"
        + (", agents.png" if doc["config"].get("driver") == "chat" else ""))


# --- command line --------------------------------------------------------------------
def _ints(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _floats(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


QUICK = dict(fanouts=(2,), lengths=(128,), rounds=(1,), output_tokens=4, rates=(0.5,), duration_s=4.0,
             probes=1, warmup=1, max_sessions=8, out="runs/bench/serve-quick")


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `python -m bench serve`."""
    a = parser.add_argument
    a("--quick", action="store_true", help="smoke run: small random model, N=2, L=128, one short load point")
    a("--systems", help="comma list of a (prefillshare), b (disagg per-model P/D), c (colocated) and their LoRA "
      "forms a-lora, b-lora, c-lora (c-lora: one multi-LoRA engine, what vLLM users run); with --driver vllm also "
      "the stock vLLM servers v-lora (multi-LoRA, prefix caching) and v-one (one model for every request: the "
      "bound on sharing); default a,b,c")
    a("--driver", choices=["project", "vllm", "chat"], help="project (default): sessions of /v1/agents/run; vllm: "
      "vLLM's own benchmark client (prefix_repetition, --disable-shuffle, the N decoders as --lora-modules "
      "round-robin: N /v1/completions per shared prefix); chat: agents with their own system prompts and tools, "
      "N streamed /v1/chat/completions per session sent together (systems a-sf-lora, a-sys-lora, v-lora, v-one); "
      "--rates are sessions/s (N requests each), --concurrency sessions in flight, --max-sessions sessions per "
      "concurrency point")
    a("--system-tokens", type=_ints, help="--driver chat: MIN,MAX tokens of each agent's system prompt (default 200,500)")
    a("--agent-tools", type=int, help="--driver chat: tools per agent (default 2)")
    a("--fanouts", type=_ints, help="N agents per round, e.g. 2,4,8")
    a("--lengths", type=_ints, help="shared context tokens L, e.g. 1024,2048,4096")
    a("--rounds", type=_ints, help="R rounds per session, e.g. 1,3")
    a("--output-tokens", type=int, help="O tokens per agent (default 32)")
    a("--rates", type=_floats, help="Poisson session arrival rates (sessions/s), e.g. 0.05,0.1,0.2")
    a("--concurrency", type=_ints, help="closed loop instead: concurrent sessions, e.g. 1,2,4")
    a("--duration", type=float, dest="duration_s", help="seconds of arrivals per load point (default 40)")
    a("--max-sessions", type=int, help="cap on sessions per load point (default 200)")
    a("--session-timeout", type=float, dest="session_timeout_s", help="seconds before a session counts as failed")
    a("--warmup", type=int, help="warm-up sessions per system, sent together (default 4)")
    a("--repeats", type=int, help="runs of every load point, fresh sessions each (default 1); ratios get a spread")
    a("--probes", type=int, help="repeats of each unloaded phase-cost probe (default 2)")
    a("--seed", type=int)
    a("--models", choices=["random", "shipped"], help="random-weight Llama (default) or the shipped checkpoints")
    a("--shape", choices=sorted(SHAPES), help="the random model's shape (default: default, 90M; qwen2.5-0.5b: "
      "Qwen2.5-0.5B's 24 layers, hidden 896); --hidden etc. change single fields of it")
    a("--hidden", type=int), a("--layers", type=int), a("--heads", type=int), a("--kv-heads", type=int)
    a("--intermediate", type=int)
    a("--kv-cache-gib", type=float, help="KV space per engine (default 0.25)")
    a("--prefill-replicas", type=int, help="shared prefill replicas in system a (default 2: one per core)")
    a("--in-engine-replicas", type=int, help="i-lora: replicas of its engine, each given cores / replicas CPUs "
      "(default 1: one engine with every core, like v-one)")
    a("--threads-bind", help="VLLM_CPU_OMP_THREADS_BIND for every engine (default nobind)")
    a("--dtype", choices=["auto", "bfloat16", "float32"],
      help="engine compute dtype; auto (default): bfloat16 where computed natively, else float32")
    a("--pool-gib", type=float, help="KV pool capacity (default 0.5; per-adapter KV in b-lora needs N times more)")
    a("--lora-rank", type=int, help="rank of the random LoRA adapters (default 16)")
    a("--lora-kv-cache-gib", type=float, help="KV space of an engine holding the N adapters (default N x --kv-cache-gib)")
    a("--colocated-replicas", type=int, help="c-lora: replicas of the multi-LoRA engine (default 2: one per core)")
    a("--max-engines", type=int, help="skip (and report) systems needing more engines (default 8)")
    a("--slo", type=float, dest="slo_s", help="p95 fan-out latency SLO in s (default: --slo-factor x the "
      "baseline's p95 at the lowest load; the baseline is b, else c-lora, else v-lora)")
    a("--slo-factor", type=float, help="default SLO as a multiple of the baseline's lowest-load p95 (default 2)")
    a("--out", help="output directory (default runs/bench/serve; with --report, beside the JSON)")
    a("--report", metavar="RESULTS_JSON", nargs="+", help="measure nothing: make the tables and plots of saved runs "
      "again (several: drawn together, e.g. N=2,4 and N=8; needs --out)")
    a("--model-dir", help="where benchmark checkpoints are written (default runs/bench/serve-models)")
    parser.set_defaults(func=_cli)


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    kw: dict = dict(QUICK) if args.quick else {}
    if args.quick:
        kw["shape"] = SMALL
        kw["topology"] = Topology(kv_cache_gib=0.125, prefill_replicas=1)
        kw["model_dir"] = "runs/bench/serve-models-quick"
    for name in ("fanouts", "lengths", "rounds", "output_tokens", "rates", "concurrency", "duration_s",
                 "max_sessions", "session_timeout_s", "warmup", "repeats", "probes", "seed", "models", "max_engines",
                 "slo_s", "slo_factor", "out", "model_dir", "driver", "system_tokens", "agent_tools"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if args.concurrency:
        kw["rates"] = ()
    if args.systems:
        kw["systems"] = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    shape = SHAPES[args.shape] if getattr(args, "shape", None) else kw.get("shape", ModelShape())
    over = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate")
            if getattr(args, k, None) is not None}
    topo = kw.get("topology", Topology())
    tover = {k: getattr(args, k) for k in ("kv_cache_gib", "prefill_replicas", "threads_bind", "dtype", "lora_rank", "pool_gib",
                                           "lora_kv_cache_gib", "colocated_replicas", "in_engine_replicas")
             if getattr(args, k, None) is not None}
    kw["shape"] = replace(shape, **over)
    kw["topology"] = replace(topo, **tover)
    return ServeBenchConfig(**kw)


def _cli(args: argparse.Namespace) -> int:
    if args.report:
        rerender(args.report, args.out)
        return 0
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    doc = run(cfg)
    return 0 if doc["points"] and all(p["ok"] > 0 for p in doc["points"]) else 1
