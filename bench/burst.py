"""A burst against an autoscaled app: base load, a burst of ``--burst`` times it, base load again.

``python -m bench burst --url URL --out DIR`` (bench/burst_run.sh serves the app for it). The
traffic is the overload run's (bench/overload.py ``Traffic``): agent fan-outs and single
completions, half of them streamed, as open-loop Poisson arrivals whose rate follows the three
phases. Every 2 s it reads the app's /metrics: each deployment's running replicas and the
autoscaler's target (``prefillshare_deployment_replicas`` / ``_target_replicas``), and the
prefill module's prefix-cache counters (``vllm:prefix_cache_hits`` / ``_queries``).

The report (burst.md, burst.json, burst.png: replicas and target over time per deployment, and
answers per second) judges the mechanism, not capacity: on a 2-core box a replica adds no CPU.
- ``scaled_up``: some deployment's target rose during the burst and its running replicas reached
  that target within ``UPSCALE_ENGINE_START_S`` (one engine start on this box) of the rise;
- ``scaled_down``: after the burst every deployment whose target rose is back to its starting
  count within its ``downscale_delay_s`` plus ``DRAIN_S`` of the burst's end;
- ``nothing_lost``: every admitted request got a complete answer or a typed error (a cut stream
  is lost), and ``errors_within_budget``: typed errors under ``ERROR_BUDGET`` of those admitted;
- ``prefix_cache_kept``: the prefill module's prefix-cache hit ratio after its upscale is at least
  ``CACHE_KEEP`` of the ratio before the burst (contexts stayed on the replica that holds them).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from bench.overload import Mix, OverloadSpec, Sampler, Traffic, models_of, open_loop
from bench.overload_report import answer_rate, is_admitted

UPSCALE_ENGINE_START_S = 180.0  # an engine start on this 2-core box while the burst runs
DRAIN_S = 60.0  # a replica chosen for removal finishes its requests (answers here take seconds)
ERROR_BUDGET = 0.005
CACHE_KEEP = 0.8


def schedule(base: float, burst: float, before_s: float, burst_s: float) -> Callable[[float], float]:
    def rate(t: float) -> float:
        return base * burst if before_s <= t < before_s + burst_s else base
    return rate


def _prefix(m: dict) -> tuple[float, float]:
    """vLLM's prefix-cache hits and queries (tokens) summed over the prefill modules' replicas."""
    def total(name: str) -> float:
        return sum(v for (n, lab), v in m.items() if n == name and dict(lab).get("deployment", "").startswith("Prefill-"))
    return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")


class CacheSampler(Sampler):
    """The overload run's sampler (memory, replicas, targets) plus the prefill module's prefix-cache counters."""

    def _loop(self) -> None:
        import httpx

        from bench.overload import app_gauges
        from bench.report import parse_metrics

        while not self._stop.is_set():
            row = {"t_s": time.perf_counter() - self._t0, **app_gauges(self.url)}
            try:
                row["prefix_hits"], row["prefix_queries"] = _prefix(parse_metrics(httpx.get(self.url + "/metrics",
                                                                                             timeout=10).text))
            except Exception:  # noqa: BLE001 - a sample missed while a replica restarts
                pass
            self.rows.append(row)
            self._stop.wait(self.period_s)


def run(spec: OverloadSpec, base: float, burst: float, before_s: float, burst_s: float, after_s: float,
        log=print) -> dict:
    traffic = Traffic(spec, models_of(spec))
    warm, _ = asyncio.run(open_loop(traffic, base, 20.0, spec.seed + 7))
    log(f"warm-up: {sum(1 for s in warm if s.outcome == 'ok')} answers at {base:g}/s")
    duration = before_s + burst_s + after_s
    log(f"burst: {base:g}/s for {before_s:.0f} s, {base * burst:g}/s for {burst_s:.0f} s, {base:g}/s for "
        f"{after_s:.0f} s")
    t0 = time.perf_counter()
    sampler = CacheSampler(spec.url, spec.app, spec.sample_s).start(t0)
    samples, wall = asyncio.run(open_loop(traffic, schedule(base, burst, before_s, burst_s), duration, spec.seed))
    time.sleep(spec.settle_s)  # the last downscales
    rows = sampler.stop()
    return {"spec": {"url": spec.url, "base_per_s": base, "burst": burst, "before_s": before_s, "burst_s": burst_s,
                     "after_s": after_s, "mix": spec.mix.__dict__, "seed": spec.seed},
            "wall_s": wall, "samples": [s.__dict__ for s in samples], "fleet": rows}


# --- the report ---------------------------------------------------------------------------------
def _series(rows: list[dict], key: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        for dep, v in (r.get(key) or {}).items():
            out.setdefault(dep, []).append((r["t_s"], v))
    return out


def scale_events(rows: list[dict], burst_start: float, burst_end: float, downscale_s: dict[str, float]) -> list[dict]:
    """Per deployment whose target rose during the burst: when it rose, when running reached it, and
    when, after the burst, running was back to its count before the burst."""
    targets, running = _series(rows, "targets"), _series(rows, "replicas")
    out = []
    for dep, ts in sorted(targets.items()):
        start = next((v for t, v in reversed(ts) if t < burst_start), ts[0][1])
        peak = max((v for t, v in ts if burst_start <= t <= burst_end), default=start)
        if peak <= start:
            continue
        rose = next(t for t, v in ts if t >= burst_start and v > start)
        run_ = running.get(dep, [])
        reached = next((t for t, v in run_ if t >= rose and v >= peak), None)
        back = next((t for t, v in run_ if t >= burst_end and v <= start), None)
        out.append({"deployment": dep, "from": start, "to": peak, "target_rose_s": rose, "reached_s": reached,
                    "up_took_s": None if reached is None else reached - rose,
                    "back_at_s": back, "down_took_s": None if back is None else back - burst_end,
                    "down_bound_s": downscale_s.get(dep, 600.0) + DRAIN_S})
    return out


def cache_ratio(rows: list[dict], start: float, end: float) -> float | None:
    inside = [r for r in rows if "prefix_queries" in r and start <= r["t_s"] <= end]
    if len(inside) < 2:
        return None
    q = inside[-1]["prefix_queries"] - inside[0]["prefix_queries"]
    return (inside[-1]["prefix_hits"] - inside[0]["prefix_hits"]) / q if q > 0 else None


def summarize(raw: dict, downscale_s: dict[str, float]) -> dict:
    spec, samples, rows = raw["spec"], raw["samples"], raw["fleet"]
    b0, b1 = spec["before_s"], spec["before_s"] + spec["burst_s"]
    outcomes: dict[str, int] = {}
    for s in samples:
        outcomes[s["outcome"]] = outcomes.get(s["outcome"], 0) + 1
    taken = [s for s in samples if is_admitted(s["outcome"])]
    errors = [s for s in taken if s["outcome"].startswith("error")]
    events = scale_events(rows, b0, b1, downscale_s)
    prefill_up = next((e for e in events if e["deployment"].startswith("Prefill-") and e["reached_s"]), None)
    before = cache_ratio(rows, 0.0, b0)
    after = cache_ratio(rows, prefill_up["reached_s"], b1) if prefill_up else None
    promises = {
        "scaled_up": bool(events) and all(e["up_took_s"] is not None and e["up_took_s"] <= UPSCALE_ENGINE_START_S
                                          for e in events),
        "scaled_down": bool(events) and all(e["down_took_s"] is not None and e["down_took_s"] <= e["down_bound_s"]
                                            for e in events),
        "nothing_lost": not any(k.startswith("lost") for k in outcomes),
        "errors_within_budget": (len(errors) / len(taken) if taken else 0.0) < ERROR_BUDGET,
    }
    if prefill_up is not None:
        promises["prefix_cache_kept"] = before is not None and after is not None and after >= CACHE_KEEP * before
    per_phase = {}
    for name, (a, z) in {"before": (0.0, b0), "burst": (b0, b1), "after": (b1, b1 + spec["after_s"])}.items():
        sent = [s for s in samples if a <= s["sent_s"] < z]
        per_phase[name] = {"sent_per_s": len(sent) / (z - a), "answers_per_s": answer_rate(samples, a, z),
                           "shed": sum(1 for s in sent if s["outcome"] == "shed")}
    return {"outcomes": dict(sorted(outcomes.items())), "admitted": len(taken), "errors": len(errors),
            "scale_events": events, "prefix_cache_hit_ratio": {"before_burst": before, "after_prefill_upscale": after},
            "phases": per_phase, "promises": promises}


def render(raw: dict, report: dict) -> str:
    spec = raw["spec"]

    def s(x):
        return "-" if x is None else f"{x:.0f} s"

    lines = [f"burst: {spec['base_per_s']:g}/s for {spec['before_s']:.0f} s, {spec['burst']:g}x for "
             f"{spec['burst_s']:.0f} s, {spec['base_per_s']:g}/s for {spec['after_s']:.0f} s "
             "(2 cores: a replica adds no CPU; this run judges the mechanism)", "",
             "| phase | sent/s | answers/s | shed (429) |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['sent_per_s']:.2f} | {v['answers_per_s']:.2f} | {v['shed']} |"
              for k, v in report["phases"].items()]
    lines += ["", "| deployment | replicas | target rose at | running reached it after | back after the burst's end "
              "(bound) |", "|---|---|---|---|---|"]
    lines += [f"| {e['deployment']} | {e['from']:.0f} -> {e['to']:.0f} | {e['target_rose_s']:.0f} s | {s(e['up_took_s'])} "
              f"| {s(e['down_took_s'])} ({e['down_bound_s']:.0f} s) |" for e in report["scale_events"]]
    c = report["prefix_cache_hit_ratio"]
    fmt = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines += ["", f"prefill prefix-cache hit ratio (vLLM's counters): before the burst {fmt(c['before_burst'])}, "
              f"after the prefill module's upscale {fmt(c['after_prefill_upscale'])}",
              f"admitted {report['admitted']}, typed errors {report['errors']}; outcomes: "
              + ", ".join(f"{k} {v}" for k, v in report["outcomes"].items()),
              "", "| promise | held |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else 'NO'} |" for k, v in report["promises"].items()]
    return "\n".join(lines)


def plot(raw: dict, report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, spec = raw["fleet"], raw["spec"]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    running, targets = _series(rows, "replicas"), _series(rows, "targets")
    for i, dep in enumerate(sorted(d for d in running if d not in ("Router", "Orchestrator"))):
        color = f"C{i}"
        ax.step(*zip(*running[dep]), where="post", color=color, label=f"{dep} running")
        if dep in targets:
            ax.step(*zip(*targets[dep]), where="post", color=color, linestyle="--", alpha=0.6, label=f"{dep} target")
    ax.set_ylabel("replicas")
    ax.legend(fontsize=7, ncol=2)
    b0, b1 = spec["before_s"], spec["before_s"] + spec["burst_s"]
    end = b1 + spec["after_s"]
    for a in (ax, bx):
        a.axvspan(b0, b1, color="grey", alpha=0.15)
    sent = [0] * int(end // 10 + 1)
    done = [0] * int(end // 10 + 1)
    for s in raw["samples"]:
        if s["sent_s"] < end:
            sent[int(s["sent_s"] // 10)] += 1
        t = s["sent_s"] + s["latency_s"]
        if s["outcome"] == "ok" and t < end:
            done[int(t // 10)] += 1
    xs = [10 * i for i in range(len(sent))]
    bx.step(xs, [x / 10 for x in sent], where="post", label="sent /s")
    bx.step(xs, [x / 10 for x in done], where="post", label="answers /s")
    bx.set_xlabel("s since the base load began (grey: the burst)")
    bx.set_ylabel("per second")
    bx.legend(fontsize=8)
    fig.suptitle("Replicas per deployment over a burst (solid: running, dashed: the autoscaler's target)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--app", default="prefillshare")
    parser.add_argument("--base", type=float, default=2.0, help="base arrivals/s")
    parser.add_argument("--burst", type=float, default=4.0, help="the burst's rate as a multiple of the base")
    parser.add_argument("--before", type=float, default=90.0, help="seconds of base load before the burst")
    parser.add_argument("--burst-s", type=float, default=180.0, help="seconds the burst holds")
    parser.add_argument("--after", type=float, default=240.0, help="seconds of base load after it")
    parser.add_argument("--downscale-delay", action="append", default=[], metavar="DEPLOYMENT=SECONDS",
                        help="each autoscaled deployment's downscale_delay_s (the report's bound); default 600")
    parser.add_argument("--models", default="")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/burst")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    mix = Mix(fanout_share=0.4, stream_share=0.5, disconnect_share=0.0, bad_share=0.0, max_tokens=args.max_tokens,
              fanout=3)
    spec = replace(OverloadSpec(url=args.url.rstrip("/"), app=args.app, models=tuple(m for m in args.models.split(",")
                                                                                     if m), mix=mix, seed=args.seed),
                   settle_s=5.0)
    downscale = dict((k, float(v)) for k, v in (d.split("=", 1) for d in args.downscale_delay))
    raw = run(spec, args.base, args.burst, args.before, args.burst_s, args.after,
              log=lambda m: print(m, file=sys.stderr, flush=True))
    report = summarize(raw, downscale)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "burst_raw.json").write_text(json.dumps(raw, separators=(",", ":")))  # the samples: to re-read, not to keep
    rows = raw["fleet"]
    changes = [{k: r[k] for k in ("t_s", "replicas", "targets") if k in r} for i, r in enumerate(rows)
               if i == 0 or any(r.get(k) != rows[i - 1].get(k) for k in ("replicas", "targets"))]
    (out / "burst.json").write_text(json.dumps({"spec": raw["spec"], "report": report, "fleet_changes": changes},
                                               separators=(",", ":")))
    text = render(raw, report)
    (out / "burst.md").write_text(text + "\n")
    plot(raw, report, out / "burst.png")
    print(text)
    return 0 if all(report["promises"].values()) else 1
