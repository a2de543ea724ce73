"""The overload run's report: windows, recovery after each fault, drift, leaks, accounting.

Each promise of docs/reliability.md "Overload and faults" is one boolean in
``report["promises"]``, computed from the samples alone, so a saved run can be re-read:
- nothing_lost: every accepted request got a complete answer or a typed error;
- shed_with_retry_after: every 429 carried Retry-After;
- bad_input_refused: every bad body got a 4xx in the app's JSON error shape;
- recovered: after each fault, the p95 of complete answers came back to within
  ``RECOVERY_FACTOR`` of its value before the fault, or within the admission target where the run
  has one, within ``RECOVERY_LIMIT_S`` (a p95 that admission held low while a deployment was short
  of replicas is not the level the app promises);
- no_drift: the last minute's p95 within ``RECOVERY_FACTOR`` of the first minute's;
- no_leaks: process memory and /dev/shm flat (last minute's median within ``LEAK_FACTOR`` of the
  first's; the pool's held bytes are a cache, only reported, and /dev/shm is judged without them) and no pinned blocks once
  traffic stopped and the pins' lease ran out;
- server_accounted: the Router's own counts balance (admitted = completed + failed + cancelled);
- errors_within_budget: admitted requests that ended in a typed error are under
  ``ERROR_BUDGET`` of those admitted (split by cause and by the fault before them in ``errors``);
- p95_within_target (runs given the app's ``admission_target_s``): each minute's p95 of complete
  answers is within it, the ``AFTER_KILL_S`` after each kill left out (``minutes``);
- capacity_recovered: after each fault, answers per second (a ``CAPACITY_WINDOW_S`` window of
  completions) are back to ``CAPACITY_FACTOR`` of the minute before the fault within
  ``CAPACITY_LIMIT_S`` of the fault's end: for a kill, the replacement's readiness (its
  deployment's running replicas back to their count before the kill, from the app's
  ``prefillshare_deployment_replicas``), else the fault's hold (``capacity``);
- capacity_held (runs with a searched saturation rate): answers per second over the whole run
  average at least ``RUN_CAPACITY_FACTOR`` of it.

The generator's own lag (how late it sent each arrival) and its CPU use are reported apart from
the app's (``client``), so a late client is not read as a slow app.

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
ERROR_BUDGET = 0.02  # admitted requests that may end in a typed error
AFTER_KILL_S = 30.0  # left out of the per-minute target check after each kill
CAPACITY_FACTOR = 0.8  # answers per second after a fault, against the minute before it
CAPACITY_LIMIT_S = 60.0  # from the fault's end (a kill's replacement ready)
CAPACITY_WINDOW_S = 20.0
RUN_CAPACITY_FACTOR = 0.7  # the run's mean answers per second, against the searched saturation rate
NOT_ADMITTED = ("shed", "bad_input_ok", "not_sent")  # and "bad_input_wrong <status>"


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


def recovery(samples: list[dict], fault: dict, window_s: float, end_s: float, target_s: float | None = None) -> dict:
    """Seconds after ``fault`` until a window's p95 is back within the factor of the p95 before it,
    or within ``target_s`` (the admission target) where given."""
    t = fault["at_s"]
    before = _p95(samples, t - BEFORE_FAULT_S, t)
    out = {"label": fault["label"], "at_s": t, "p95_before_s": before, "recovery_s": None}
    if before is None:
        return out
    bound = max(RECOVERY_FACTOR * before, target_s or 0.0)
    out["recovered_under_s"] = bound
    step = window_s / 2
    at = t
    while at + window_s <= end_s:
        p95 = _p95(samples, at, at + window_s)
        if p95 is not None and p95 <= bound:
            out.update(recovery_s=at - t, p95_after_s=p95)
            break
        at += step
    return out


def answer_rate(samples: list[dict], start: float, end: float) -> float:
    """Complete answers per second finished in [start, end)."""
    done = sum(1 for s in samples if s["outcome"] == "ok" and start <= s["sent_s"] + s["latency_s"] < end)
    return done / max(end - start, 1e-9)


def ready_after(memory: list[dict], fault: dict) -> float | None:
    """When a killed deployment's running replicas were back to their count before the kill (None:
    not within the run, or the run sampled no replica counts)."""
    dep, t = fault.get("deployment"), fault["at_s"]
    rows = [r for r in memory if "replicas" in r]
    before = [r["replicas"][dep] for r in rows if r["t_s"] < t and dep in r["replicas"]]
    if not before:
        return None
    # the controller reports the loss a few seconds after the kill: back means after the loss was seen
    lost = next((r["t_s"] for r in rows if r["t_s"] >= t and r["replicas"].get(dep, 0) < before[-1]), None)
    if lost is None:
        return t
    return next((r["t_s"] for r in rows if r["t_s"] > lost and r["replicas"].get(dep, 0) >= before[-1]), None)


def capacity(samples: list[dict], memory: list[dict], fault: dict, end_s: float) -> dict:
    """Answers per second in the minute before ``fault`` and how long after its end a
    ``CAPACITY_WINDOW_S`` window of completions was back to ``CAPACITY_FACTOR`` of that."""
    t = fault["at_s"]
    before = answer_rate(samples, max(0.0, t - 60.0), t)
    ended = ready_after(memory, fault) if fault.get("kind") == "kill" else t + float(fault.get("hold_s") or 0.0)
    out = {"label": fault["label"], "at_s": t, "answers_per_s_before": before, "ended_s": ended,
           "back_after_s": None, "answers_per_s_after": None}
    if ended is None:
        return out
    at = ended
    while at + CAPACITY_WINDOW_S <= end_s and at <= ended + CAPACITY_LIMIT_S:
        rate = answer_rate(samples, at, at + CAPACITY_WINDOW_S)
        if rate >= CAPACITY_FACTOR * before:
            out.update(back_after_s=at - ended, answers_per_s_after=rate)
            break
        at += CAPACITY_WINDOW_S / 4
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


def is_admitted(outcome: str) -> bool:
    return outcome not in NOT_ADMITTED and not outcome.startswith("bad_input_wrong")


def errors(samples: list[dict], faults: list[dict]) -> dict:
    """Admitted requests and those that ended in a typed error, by cause (the error's code) and
    by the fault fired last before they were sent ("before any fault" for the first ones)."""
    fired = sorted(faults, key=lambda f: f["at_s"])
    admitted = [s for s in samples if is_admitted(s["outcome"])]
    failed = [s for s in admitted if s["outcome"].startswith("error")]
    by_cause: dict[str, int] = {}
    by_fault: dict[str, dict[str, int]] = {}
    for s in failed:
        cause = s["outcome"].removeprefix("error ").strip()
        by_cause[cause] = by_cause.get(cause, 0) + 1
        label = next((f["label"] for f in reversed(fired) if f["at_s"] <= s["sent_s"]), "before any fault")
        row = by_fault.setdefault(label, {})
        row[cause] = row.get(cause, 0) + 1
    return {"admitted": len(admitted), "errors": len(failed),
            "share": len(failed) / len(admitted) if admitted else 0.0,
            "by_cause": dict(sorted(by_cause.items())), "by_fault": by_fault}


def minutes(samples: list[dict], faults: list[dict], duration_s: float, target_s: float | None) -> list[dict]:
    """Each minute's p95 of complete answers (by send time), the ``AFTER_KILL_S`` after each kill
    left out, against the admission target."""
    kills = [f["at_s"] for f in faults if f.get("kind") == "kill"]
    rows = []
    for i in range(max(1, int(-(-duration_s // 60)))):
        start, end = i * 60.0, min((i + 1) * 60.0, duration_s)
        lat = [s["latency_s"] for s in samples if s["outcome"] == "ok" and start <= s["sent_s"] < end
               and not any(k <= s["sent_s"] < k + AFTER_KILL_S for k in kills)]
        p95 = percentile(lat, 95) if len(lat) >= MIN_SAMPLES else None
        rows.append({"start_s": start, "answers": len(lat), "p95_s": p95,
                     "within_target": None if p95 is None or target_s is None else p95 <= target_s})
    return rows


def client_share(raw: dict) -> dict | None:
    """The generator's lag (how late it sent arrivals) and its CPU against the machine's."""
    samples, c = raw["samples"], raw.get("client")
    lags = [s.get("lag_s", 0.0) for s in samples if s["outcome"] != "not_sent"]
    if c is None or not lags:
        return None
    busy = c["machine_busy_cpu_s"]
    return {"lag_p50_s": percentile(lags, 50), "lag_p95_s": percentile(lags, 95), "lag_max_s": max(lags),
            "not_sent": sum(1 for s in samples if s["outcome"] == "not_sent"),
            "client_cpu_s": c["cpu_s"], "machine_busy_cpu_s": busy, "app_and_rest_cpu_s": busy - c["cpu_s"],
            "client_share_of_busy": c["cpu_s"] / busy if busy else None, "wall_s": c["wall_s"], "cores": c["cores"]}


def cpu_by_minute(memory: list[dict], duration_s: float) -> list[dict]:
    """CPU seconds each role (bench.overload.role_of) spent in each minute, from the sampler's
    cumulative ``cpu_s``; empty for a run sampled without it."""
    rows = [r for r in memory if "cpu_s" in r]
    out = []
    for i in range(max(1, int(-(-duration_s // 60)))):
        start, end = i * 60.0, (i + 1) * 60.0
        inside = [r for r in rows if start <= r["t_s"] <= end]
        before = [r for r in rows if r["t_s"] <= start]
        if not inside:
            continue
        a, b = (before[-1] if before else inside[0])["cpu_s"], inside[-1]["cpu_s"]
        out.append({"start_s": start, "cpu_s": {k: v - a.get(k, 0.0) for k, v in b.items() if v - a.get(k, 0.0) > 0}})
    return out


def summarize(raw: dict) -> dict:
    spec, samples = raw["spec"], raw["samples"]
    duration, window_s = spec["duration_s"], spec["window_s"]
    outcomes: dict[str, int] = {}
    for s in samples:
        outcomes[s["outcome"]] = outcomes.get(s["outcome"], 0) + 1
    target = spec.get("admission_target_s")
    faults = [recovery(samples, f, window_s, duration, target) for f in raw["faults"]]
    first, last = _p95(samples, 0, 60), _p95(samples, duration - 60, duration)
    mem = leaks(raw["memory"], duration)
    acc = accounting(raw)
    errs = errors(samples, raw["faults"])
    per_minute = minutes(samples, raw["faults"], duration, target)
    # the pool's held bytes are a cache that fills by design: reported, not judged; /dev/shm is
    # judged without them where the pool was sampled
    unjudged = {"held_bytes"} | ({"dev_shm_used_bytes"} if mem["dev_shm_beyond_pool_bytes"]["ratio"] else set())
    flat = all(v["ratio"] is None or v["ratio"] <= LEAK_FACTOR for k, v in mem.items()
               if isinstance(v, dict) and k not in unjudged)
    promises = {
        "nothing_lost": not any(k.startswith("lost") for k in outcomes),
        "shed_with_retry_after": not {"lost 429 without Retry-After", "lost 503 without Retry-After"} & set(outcomes),
        "bad_input_refused": not any(k.startswith("bad_input_wrong") for k in outcomes),
        "recovered": all(f["recovery_s"] is not None and f["recovery_s"] <= RECOVERY_LIMIT_S for f in faults),
        "no_drift": first is not None and last is not None and last <= RECOVERY_FACTOR * first,
        "no_leaks": flat and not mem["pinned_blocks_after"],
        "server_accounted": acc is not None and acc["admitted"] == acc["completed"] + acc["failed"] + acc["cancelled"]
        and acc["inflight_after"] == 0,
        "errors_within_budget": errs["share"] < ERROR_BUDGET,
    }
    if target is not None:
        promises["p95_within_target"] = all(m["within_target"] is not False for m in per_minute)
    caps = [capacity(samples, raw["memory"], f, duration) for f in raw["faults"]]
    promises["capacity_recovered"] = all(c["back_after_s"] is not None for c in caps)
    run_rate = answer_rate(samples, 0.0, duration)
    sat = raw.get("saturation_per_s")
    if sat:
        promises["capacity_held"] = run_rate >= RUN_CAPACITY_FACTOR * sat
    return {"capacity": caps, "answers_per_s": run_rate, "requests": len(samples), "outcomes": dict(sorted(outcomes.items())), "faults": faults,
            "p95_first_minute_s": first, "p95_last_minute_s": last, "leaks": mem, "server": acc,
            "fallbacks": fallback_delta(raw), "errors": errs, "minutes": per_minute, "admission_target_s": target,
            "client": client_share(raw), "cpu_by_minute": cpu_by_minute(raw["memory"], duration),
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
    lines += ["", "| fault | at | p95 before | recovered after (p95 back under) |", "|---|---|---|---|"]
    lines += [f"| {f['label']} | {f['at_s']:.0f} s | {ms(f['p95_before_s'])} | "
              f"{secs(f['recovery_s'])} ({ms(f.get('recovered_under_s'))}) |" for f in report["faults"]]
    if report.get("capacity") is not None:
        lines += ["", f"answers per second after each fault (back to {CAPACITY_FACTOR:g}x the minute before, "
                  f"within {CAPACITY_LIMIT_S:.0f} s of the fault's end: a kill's replacement ready):",
                  "| fault | before | fault ended | back after | then |", "|---|---|---|---|---|"]
        lines += [f"| {c['label']} | {c['answers_per_s_before']:.1f}/s | "
                  f"{'-' if c['ended_s'] is None else format(c['ended_s'], '.0f') + ' s'} | {secs(c['back_after_s'])} | "
                  f"{'-' if c['answers_per_s_after'] is None else format(c['answers_per_s_after'], '.1f') + '/s'} |"
                  for c in report["capacity"]]
        lines += [f"answers per second over the run: {report['answers_per_s']:.2f}"
                  + (f" ({report['answers_per_s'] / sat:.2f}x the saturation rate)" if sat else "")]
    lines += ["", f"p95 first minute {ms(report['p95_first_minute_s'])}, last minute {ms(report['p95_last_minute_s'])}"]
    e = report.get("errors")
    if e is not None:
        lines += ["", f"admitted requests ending in a typed error: {e['errors']} of {e['admitted']} "
                  f"({100 * e['share']:.2f}%; budget {100 * ERROR_BUDGET:.0f}%)"]
        if e["by_fault"]:
            causes = sorted(e["by_cause"])
            lines += ["", "| after | " + " | ".join(causes) + " |", "|---|" + "---|" * len(causes)]
            lines += [f"| {label} | " + " | ".join(str(row.get(c, 0)) for c in causes) + " |"
                      for label, row in e["by_fault"].items()]
    target = report.get("admission_target_s")
    if report.get("minutes"):
        head = f"p95 of complete answers per minute ({AFTER_KILL_S:.0f} s after each kill left out)"
        lines += ["", head + (f", target {target:g} s" if target is not None else "") + ":",
                  "| minute | answers | p95 | within target |", "|---|---|---|---|"]
        lines += [f"| {int(m['start_s'] // 60)} | {m['answers']} | {ms(m['p95_s'])} | "
                  f"{'-' if m['within_target'] is None else 'yes' if m['within_target'] else 'NO'} |"
                  for m in report["minutes"]]
    c = report.get("client")
    if c is not None:
        share = "-" if c["client_share_of_busy"] is None else f"{100 * c['client_share_of_busy']:.0f}%"
        lines += ["", f"load generator: sent arrivals late by p50 {ms(c['lag_p50_s'])}, p95 {ms(c['lag_p95_s'])}, "
                  f"max {ms(c['lag_max_s'])}; {c['not_sent']} not sent (its cap); its CPU {c['client_cpu_s']:.0f} s "
                  f"= {share} of the machine's busy {c['machine_busy_cpu_s']:.0f} s over {c['wall_s']:.0f} s on "
                  f"{c['cores']} cores (the app and the rest: {c['app_and_rest_cpu_s']:.0f} s)"]
    lines += _cpu_table(report.get("cpu_by_minute") or [])
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


def _cpu_table(rows: list[dict], top: int = 8) -> list[str]:
    """Each minute's CPU seconds by role, the ``top`` roles by total as columns, the rest summed."""
    if not rows:
        return []
    totals: dict[str, float] = {}
    for r in rows:
        for k, v in r["cpu_s"].items():
            totals[k] = totals.get(k, 0.0) + v
    cols = sorted(totals, key=lambda k: -totals[k])[:top]
    head = ["", "CPU seconds by process role per minute (2 cores give 120 s a minute):",
            "| minute | " + " | ".join(cols) + " | rest | all |", "|---|" + "---|" * (len(cols) + 2)]
    body = []
    for r in rows:
        c = r["cpu_s"]
        rest = sum(v for k, v in c.items() if k not in cols)
        body.append(f"| {int(r['start_s'] // 60)} | " + " | ".join(f"{c.get(k, 0.0):.0f}" for k in cols)
                    + f" | {rest:.0f} | {sum(c.values()):.0f} |")
    return head + body


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
