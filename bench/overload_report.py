"""The overload run's report: windows, recovery after each fault, drift, leaks, accounting.

Each promise of docs/reliability.md "Overload and faults" is one boolean in
``report["promises"]``, computed from the samples alone, so a saved run can be re-read:
- nothing_lost: every accepted request got a complete answer or a typed error;
- shed_with_retry_after: every 429 carried Retry-After;
- bad_input_refused: every bad body got a 4xx in the app's JSON error shape;
- recovered: after each fault, the p95 of complete answers came back to within
  ``RECOVERY_FACTOR`` of its value before the fault within ``RECOVERY_LIMIT_S``;
- no_drift: the last minute's p95 within ``RECOVERY_FACTOR`` of the first minute's;
- no_leaks: process memory and /dev/shm flat (last minute's median within ``LEAK_FACTOR`` of the
  first's; the pool's held bytes are a cache, only reported, and /dev/shm is judged without them) and no pinned blocks once
  traffic stopped and the pins' lease ran out;
- server_accounted: the Router's own counts balance (admitted = completed + failed + cancelled).

Not a promise but counted: ``fallbacks``, the run's increments of ``prefillshare_fallbacks_total``
by reason, whose ``decoder_retry`` (a decode repeated once because its replica died before any
output reached the client) and ``router_retry`` (the same for a whole call) are the retries where safe.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.soak import percentile, server_delta

RECOVERY_FACTOR = 1.25
RECOVERY_LIMIT_S = 60.0
LEAK_FACTOR = 1.10
BEFORE_FAULT_S = 30.0
MIN_SAMPLES = 3  # a window with fewer complete answers says nothing about p95


def _ok_latencies(samples: list[dict], start: float, end: float) -> list[float]:
    return [s["latency_s"] for s in samples if s["outcome"] == "ok" and start <= s["sent_s"] < end]


def _p95(samples: list[dict], start: float, end: float) -> float | None:
    lat = _ok_latencies(samples, start, end)
    return percentile(lat, 95) if len(lat) >= MIN_SAMPLES else None


def windows(samples: list[dict], duration_s: float, window_s: float) -> list[dict]:
    """Per window of send time: counts by outcome and latency percentiles of complete answers;
    throughput counts answers by the time they completed."""
    n = max(1, int(-(-duration_s // window_s)))
    rows = [{"start_s": i * window_s, "sent": 0, "outcomes": {}, "completed_per_s": 0.0} for i in range(n)]
    for s in samples:
        w = rows[min(int(s["sent_s"] // window_s), n - 1)]
        w["sent"] += 1
        w["outcomes"][s["outcome"]] = w["outcomes"].get(s["outcome"], 0) + 1
        if s["outcome"] == "ok":
            done = rows[min(int((s["sent_s"] + s["latency_s"]) // window_s), n - 1)]
            done["completed_per_s"] += 1 / window_s
    for w in rows:
        lat = _ok_latencies(samples, w["start_s"], w["start_s"] + window_s)
        w.update({f"p{q}_s": percentile(lat, q) for q in (50, 95, 99)})
    return rows


def recovery(samples: list[dict], fault: dict, window_s: float, end_s: float) -> dict:
    """Seconds after ``fault`` until a window's p95 is back within the factor of the p95 before it."""
    t = fault["at_s"]
    before = _p95(samples, t - BEFORE_FAULT_S, t)
    out = {"label": fault["label"], "at_s": t, "p95_before_s": before, "recovery_s": None}
    if before is None:
        return out
    step = window_s / 2
    at = t
    while at + window_s <= end_s:
        p95 = _p95(samples, at, at + window_s)
        if p95 is not None and p95 <= RECOVERY_FACTOR * before:
            out.update(recovery_s=at - t, p95_after_s=p95)
            break
        at += step
    return out


def _median(rows: list[dict], key: str, start: float, end: float) -> float | None:
    vals = [r[key] for r in rows if key in r and start <= r["t_s"] < end]
    return statistics.median(vals) if vals else None


def leaks(memory: list[dict], duration_s: float) -> dict:
    """First and last minute's medians of each memory series. The KV pool's slab is in /dev/shm and
    fills as the cache does, so /dev/shm is also given without the pool's held bytes
    (``dev_shm_beyond_pool_bytes``): what anything else the app made there takes."""
    memory = [{**r, "dev_shm_beyond_pool_bytes": r["dev_shm_used_bytes"] - r["held_bytes"]}
              if "dev_shm_used_bytes" in r and "held_bytes" in r else r for r in memory]
    out = {}
    for key in ("replica_rss_bytes", "engine_rss_bytes", "dev_shm_used_bytes", "dev_shm_beyond_pool_bytes",
                "held_bytes"):
        first, last = _median(memory, key, 0, 60), _median(memory, key, duration_s - 60, duration_s)
        out[key] = {"first_minute": first, "last_minute": last,
                    "ratio": last / first if first and last is not None else None}
    tail = [r for r in memory if "pinned_blocks" in r]
    out["pinned_blocks_after"] = tail[-1]["pinned_blocks"] if tail else None
    return out


def accounting(raw: dict) -> dict | None:
    """The Router's own counts over the run (``/ready`` before and after)."""
    return server_delta(raw.get("server_before"), raw.get("server_after"))


def fallback_delta(raw: dict) -> dict[str, float] | None:
    """The run's fallbacks by reason (None where /metrics was not read: a run saved before it was)."""
    before, after = raw.get("fallbacks_before"), raw.get("fallbacks_after")
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v - before.get(k, 0.0)}


def summarize(raw: dict) -> dict:
    spec, samples = raw["spec"], raw["samples"]
    duration, window_s = spec["duration_s"], spec["window_s"]
    outcomes: dict[str, int] = {}
    for s in samples:
        outcomes[s["outcome"]] = outcomes.get(s["outcome"], 0) + 1
    faults = [recovery(samples, f, window_s, duration) for f in raw["faults"]]
    first, last = _p95(samples, 0, 60), _p95(samples, duration - 60, duration)
    mem = leaks(raw["memory"], duration)
    acc = accounting(raw)
    # the pool's held bytes are a cache that fills by design: reported, not judged; /dev/shm is
    # judged without them where the pool was sampled
    unjudged = {"held_bytes"} | ({"dev_shm_used_bytes"} if mem["dev_shm_beyond_pool_bytes"]["ratio"] else set())
    flat = all(v["ratio"] is None or v["ratio"] <= LEAK_FACTOR for k, v in mem.items()
               if isinstance(v, dict) and k not in unjudged)
    promises = {
        "nothing_lost": not any(k.startswith("lost") for k in outcomes),
        "shed_with_retry_after": "lost 429 without Retry-After" not in outcomes,
        "bad_input_refused": not any(k.startswith("bad_input_wrong") for k in outcomes),
        "recovered": all(f["recovery_s"] is not None and f["recovery_s"] <= RECOVERY_LIMIT_S for f in faults),
        "no_drift": first is not None and last is not None and last <= RECOVERY_FACTOR * first,
        "no_leaks": flat and not mem["pinned_blocks_after"],
        "server_accounted": acc is not None and acc["admitted"] == acc["completed"] + acc["failed"] + acc["cancelled"]
        and acc["inflight_after"] == 0,
    }
    return {"requests": len(samples), "outcomes": dict(sorted(outcomes.items())), "faults": faults,
            "p95_first_minute_s": first, "p95_last_minute_s": last, "leaks": mem, "server": acc,
            "fallbacks": fallback_delta(raw),
            "windows": windows(samples, duration, window_s), "promises": promises,
            "saturation_per_s": raw.get("saturation_per_s"), "rate_per_s": raw.get("rate_per_s")}


def render(report: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.0f} ms"

    def secs(x):
        return "not within the run" if x is None else f"{x:.0f} s"

    sat = report["saturation_per_s"]
    lines = [f"overload: {report['requests']} arrivals at {report['rate_per_s']:.2f}/s"
             + (f" ({report['rate_per_s'] / sat:.1f}x the saturation rate {sat:.2f}/s)" if sat else ""),
             "", "| outcome | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["outcomes"].items()]
    lines += ["", "| fault | at | p95 before | recovered after |", "|---|---|---|---|"]
    lines += [f"| {f['label']} | {f['at_s']:.0f} s | {ms(f['p95_before_s'])} | "
              f"{secs(f['recovery_s'])} |" for f in report["faults"]]
    lines += ["", f"p95 first minute {ms(report['p95_first_minute_s'])}, last minute {ms(report['p95_last_minute_s'])}"]
    for k, v in report["leaks"].items():
        if isinstance(v, dict) and v["ratio"] is not None:
            lines.append(f"{k}: first minute {v['first_minute'] / 2**20:.0f} MiB, last {v['last_minute'] / 2**20:.0f} MiB"
                         f" ({v['ratio']:.2f}x)")
    lines.append(f"pinned blocks after the run: {report['leaks']['pinned_blocks_after']}")
    if report["server"]:
        lines.append("server accounting: " + ", ".join(f"{k} {v}" for k, v in report["server"].items()))
    fb = report.get("fallbacks")
    if fb is not None:
        retries = {k: fb.get(k, 0.0) for k in ("decoder_retry", "router_retry")}
        lines.append("retried where safe: " + ", ".join(f"{k} {v:.0f}" for k, v in retries.items())
                     + "; fallbacks by reason: " + (", ".join(f"{k} {v:.0f}" for k, v in fb.items()) or "none"))
    lines += ["", "| promise | held |", "|---|---|"] + [f"| {k} | {'yes' if v else 'NO'} |"
                                                     for k, v in report["promises"].items()]
    return "\n".join(lines)


def plot(raw: dict, report: dict, path: Path) -> None:
    """Latency percentiles, throughput, outcomes and memory over time, faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, w = report["windows"], raw["spec"]["window_s"]
    t = [r["start_s"] + w / 2 for r in rows]
    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for q in (50, 95, 99):
        ax[0].plot(t, [r[f"p{q}_s"] for r in rows], label=f"p{q}")
    ax[0].set_ylabel("latency of complete answers (s)")
    ax[0].set_yscale("log")
    ax[1].plot(t, [r["completed_per_s"] for r in rows], label="complete answers/s")
    ax[1].plot(t, [r["outcomes"].get("shed", 0) / w for r in rows], label="shed (429)/s")
    ax[1].set_ylabel("per second")
    bound = [m for m in raw["memory"] if "admission_limit" in m]
    if bound:  # the Routers' admission bound (steered by limits.admission_target_s)
        twin = ax[1].twinx()
        twin.plot([m["t_s"] for m in bound], [m["admission_limit"] for m in bound], color="grey",
                  linestyle=":", label="admitted at once, at most")
        twin.set_ylabel("requests")
        twin.set_ylim(bottom=0)
        twin.legend(fontsize=7, loc="upper right")
    codes = sorted({k for r in rows for k in r["outcomes"] if k not in ("ok", "shed", "bad_input_ok")})
    bottom = [0.0] * len(rows)
    for code in codes:
        vals = [r["outcomes"].get(code, 0) for r in rows]
        ax[2].bar(t, vals, width=w * 0.9, bottom=bottom, label=code)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[2].set_ylabel("other outcomes per window")
    mem = raw["memory"]
    for key, label in (("replica_rss_bytes", "replica RSS"), ("engine_rss_bytes", "engine RSS"),
                       ("dev_shm_used_bytes", "/dev/shm used"), ("held_bytes", "KV pool held (in /dev/shm)")):
        ax[3].plot([m["t_s"] for m in mem], [m.get(key, 0) / 2**30 for m in mem], label=label)
    ax[3].set_ylabel("GiB")
    ax[3].set_xlabel("seconds since the overload phase started")
    for a in ax:
        for f in raw["faults"]:
            a.axvline(f["at_s"], color="red", linestyle="--", linewidth=0.8)
        a.legend(fontsize=7, loc="upper left")
    for f in raw["faults"]:
        ax[0].annotate(f["label"], (f["at_s"], 1), xycoords=("data", "axes fraction"), rotation=90,
                       fontsize=7, va="top", color="red")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(raw: dict, report: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps({"report": report, "raw": raw}, indent=1))
    text = render(report)
    (out / "overload.md").write_text(text + "\n")
    plot(raw, report, out / "overload.png")
    return text
