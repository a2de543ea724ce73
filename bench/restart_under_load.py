"""How long a killed decoder takes to come back under load, with and without
``engine.serving_niceness``, side by side in one run.

The multi-node overload run's layout (bench/overload_multinode.py: three raylets on this machine,
hand-over vllm-nixl, the KV secret on). For each arm in turn (the niceness set on every engine of
serve_config.yaml's application): deploy, hold open-loop arrivals at ``--rate`` (the overload run's
mix), SIGKILL ``Decode-lookup``'s replica after ``--warmup-s`` and time until the Router's ``/ready``
says every engine answers again; the load goes on for ``--load-s`` in all. Per arm: the restart
time, and what the other requests got meanwhile (complete answers/s and their p95, typed errors).
Arms alternate (``--repeats``); the summary prints the ratio of the median restart times.

    bash bench/restart_under_load.sh [OUT_DIR] [--rate 20] [--repeats 1] [--arms 19,0]

On one machine every raylet shares the cores: behaviour on a shared-CPU node, not a cluster's capacity.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

from bench.overload_multinode import APP, DECODE_NODE, PREFILL_NODE, app_config

VICTIM = "Decode-lookup"


def arm_config(tag: str, niceness: int) -> dict:
    cfg = app_config(tag)
    for dep in cfg["prefill_modules"] + cfg["decoders"]:
        dep["engine"] = {**dep["engine"], "serving_niceness": niceness}
    return cfg


def measure(url: str, rate: float, warmup_s: float, load_s: float, seed: int) -> dict:
    """Load for ``load_s``; the victim killed at ``warmup_s``; the seconds until /ready again."""
    from bench.faults import FaultSpec, inject
    from bench.overload import OverloadSpec, Traffic, models_of, open_loop
    from bench.report import percentile
    from prefillshare.agents import APITimeoutError, Client

    spec = OverloadSpec(url=url, app=APP, duration_s=load_s, rate=rate, seed=seed)
    traffic = Traffic(spec, models_of(spec))
    state: dict = {}

    def watch() -> None:  # polls /ready from the kill on (its own thread: the load loop stays on time)
        while "killed_at" not in state:
            time.sleep(0.2)
        time.sleep(2)  # the Router sees the dead replica first
        with Client(url, timeout=5, retries=0) as c:  # one probe a second, no retry hiding a 503
            with contextlib.suppress(APITimeoutError):  # not back within 900 s: restart_s stays None
                c.wait_ready(timeout_s=900, interval_s=1)
                state["ready_s"] = time.perf_counter() - state["killed_at"]

    def tick(elapsed_s: float) -> None:
        if elapsed_s >= warmup_s and "killed_at" not in state:
            inject(FaultSpec.parse(f"0:kill:{VICTIM}"), APP)
            state["killed_at"], state["killed_elapsed_s"] = time.perf_counter(), elapsed_s

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    samples, _ = asyncio.run(open_loop(traffic, rate, load_s, seed, on_tick=tick))
    watcher.join(900)
    kill_at = state["killed_elapsed_s"]
    restart_s = state.get("ready_s")
    end = kill_at + (restart_s if restart_s is not None else load_s - kill_at)
    during = [s for s in samples if kill_at <= s.sent_s < min(end, load_s)]
    before = [s for s in samples if kill_at - 20 <= s.sent_s < kill_at]

    def summary(part: list, span_s: float) -> dict:
        ok = [s.latency_s for s in part if s.outcome == "ok"]
        p95 = percentile(ok, 95)
        return {"sent": len(part), "ok": len(ok), "ok_per_s": round(len(ok) / max(span_s, 1e-9), 2),
                "p95_s": round(p95, 2) if p95 is not None else None,
                "typed_errors": sum(1 for s in part if s.outcome.startswith("error")),
                "lost": sum(1 for s in part if s.outcome.startswith("lost"))}

    return {"restart_s": round(restart_s, 1) if restart_s is not None else None,
            "restart_within_load": restart_s is not None and kill_at + restart_s <= load_s,
            "killed_at_s": round(kill_at, 1), "before_kill": summary(before, 20),
            "during_restart": summary(during, min(end, load_s) - kill_at)}


def main() -> int:
    import ray
    from ray import serve

    from bench.local_cluster import free_port, start_local_cluster
    from prefillshare.agents import Client
    from prefillshare.app.config import load_config
    from prefillshare.deployments.application import build

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default="runs/restart_under_load")
    p.add_argument("--rate", type=float, default=20.0, help="arrivals/s (the overload run's mix)")
    p.add_argument("--warmup-s", type=float, default=40.0)
    p.add_argument("--load-s", type=float, default=240.0)
    p.add_argument("--arms", default="19,0", help="serving_niceness of each arm, in the order run")
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = [int(x) for x in a.arms.split(",")]
    tag = str(os.getpid())
    os.environ["RAY_TMPDIR"] = tmp = f"/tmp/ps-rul-{tag}"
    os.environ.setdefault("PREFILLSHARE_KV_SECRET", f"restart-under-load-{tag}-" + "k" * 16)
    shm_before = set(os.listdir("/dev/shm"))
    runs: list[dict] = []
    cluster = None
    try:
        cluster, _ = start_local_cluster(PREFILL_NODE, DECODE_NODE, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        for r in range(a.repeats):
            for niceness in arms:
                cfg = load_config(arm_config(tag, niceness))
                serve.run(build(cfg), name=APP, route_prefix="/", blocking=False)
                with Client(url, retries=5, backoff_s=0.5) as c:
                    c.wait_ready(timeout_s=900, interval_s=2)
                time.sleep(10)  # the last engine's start settles
                res = measure(url, a.rate, a.warmup_s, a.load_s, seed=r)
                res.update(serving_niceness=niceness, repeat=r, load_average=os.getloadavg())
                print(json.dumps(res), flush=True)
                runs.append(res)
                serve.delete(APP)
                shutil.rmtree(cfg.pool.path, ignore_errors=True)
                time.sleep(10)
    finally:
        serve.shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    by_arm = {n: [x["restart_s"] for x in runs if x["serving_niceness"] == n and x["restart_s"] is not None]
              for n in arms}
    medians = {n: statistics.median(v) if v else None for n, v in by_arm.items()}
    summary = {"rate_per_s": a.rate, "victim": VICTIM, "restart_s_median": medians, "runs": runs}
    if len(arms) == 2 and all(medians.values()):
        summary["ratio"] = round(medians[arms[1]] / medians[arms[0]], 2)
        print(f"restart of {VICTIM} under {a.rate:g} arrivals/s: serving_niceness {arms[0]}: "
              f"{medians[arms[0]]:.1f} s, {arms[1]}: {medians[arms[1]]:.1f} s "
              f"({summary['ratio']}x as long without)", flush=True)
    (out / "restart_under_load.json").write_text(json.dumps(summary, indent=1))
    time.sleep(5)
    left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    print(f"/dev/shm entries left after the stop: {left or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
