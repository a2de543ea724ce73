"""The overload run of docs/reliability.md across nodes: a local three-raylet Ray cluster (head,
prefill node, decode node, as the KubeRay worker groups give their pods), the shipped models,
hand-over `vllm-nixl` (vLLM's NixlConnector, the KV secret on). The prefill module runs on the
prefill node, `lookup` and `tool_call` on the decode node, `reschedule` and `route` on the
prefill node; every decoder pulls the base's KV over NIXL. `python -m bench overload` then holds
2x the searched saturation with a stalled NIXL peer (the prefill replica's engine core
SIGSTOPped for 20 s, then resumed: `stall:Prefill-base#engine`), a killed decode-node decoder
and a killed prefill replica.

    bash bench/overload_multinode.sh [OUT_DIR] [DURATION_S]

On one machine every raylet shares the cores, so the figures show behaviour, not capacity.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PREFILL_NODE = {"num_cpus": 0, "resources": {"prefill_node": 1}}
DECODE_NODE = {"num_cpus": 0, "resources": {"decode_node": 1}}
APP = "prefillshare"


def app_config(tag: str) -> dict:
    """serve_config.yaml's application, its engines placed on the two nodes, the KV over vLLM's
    NixlConnector."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]["config"]
    cfg["handover"] = "vllm-nixl"
    cfg["pool"].update({"path": f"/dev/shm/ps-ovmn-{tag}"})
    cfg.setdefault("engine_env", {})["VLLM_HOST_IP"] = "127.0.0.1"
    on = {"prefill": {"prefill_node": 0.1}, "decode": {"decode_node": 0.1}}
    for m in cfg["prefill_modules"]:
        m["placement"] = {"num_replicas": 1, "num_cpus": 0, "placement_group_bundles": [on["prefill"]]}
    where = {"lookup": "decode", "tool_call": "decode", "reschedule": "prefill", "route": "prefill"}
    for d in cfg["decoders"]:
        d["placement"] = {"num_replicas": 1, "num_cpus": 0, "placement_group_bundles": [on[where[d["name"]]]]}
    return cfg


def main(out: Path, duration_s: float) -> int:
    import ray
    from ray import serve

    from bench.local_cluster import free_port, start_local_cluster
    from bench.overload import FaultSpec, OverloadSpec, run
    from bench.overload_report import summarize, write
    from prefillshare.agents import Client
    from prefillshare.app.config import load_config
    from prefillshare.deployments.application import build

    tag = str(os.getpid())
    os.environ["RAY_TMPDIR"] = tmp = f"/tmp/ps-ovmn-{tag}"
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = app_config(tag)
    # the raylets, their workers and engines inherit it (KubeRay pods get it from a Secret)
    os.environ.setdefault("PREFILLSHARE_KV_SECRET", f"overload-multinode-{tag}-" + "k" * 16)
    (out / "app_config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    cfg = load_config(cfg_dict)
    shm_before = set(os.listdir("/dev/shm"))
    cluster = None
    finished = False
    try:
        cluster, _ = start_local_cluster(PREFILL_NODE, DECODE_NODE, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(cfg), name=APP, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        with Client(url, retries=5, backoff_s=0.5) as c:
            c.wait_ready(timeout_s=900, interval_s=2)
        print(f"app ready; load average {os.getloadavg()}", flush=True)
        t = duration_s / 4
        faults = (f"{t:.0f}:stall:Prefill-base#engine:20", f"{2 * t:.0f}:kill:Decode-lookup",
                  f"{3 * t:.0f}:kill:Prefill-base")
        spec = OverloadSpec(url=url, app=APP, duration_s=duration_s,
                            faults=tuple(FaultSpec.parse(f) for f in faults))
        raw = run(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
        raw["setup"] = {"nodes": "head (2 CPUs: ingress, Serve) + prefill node + decode node, one machine",
                        "handover": "vllm-nixl", "decode_node": ["lookup", "tool_call"],
                        "prefill_node": ["base", "reschedule", "route"]}
        report = summarize(raw)
        print(write(raw, report, out))
        finished = True
        return 0 if report["promises"]["nothing_lost"] else 1
    finally:
        serve.shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(cfg.pool.path, ignore_errors=True)
        for logs in ([] if finished else Path(tmp).glob("**/session_latest/logs")):
            # a run that failed (e.g. an app that did not start): keep the cluster's logs
            shutil.copytree(logs, out / "ray_logs", dirs_exist_ok=True, ignore_dangling_symlinks=True)
            print(f"the run did not finish: Ray's logs are in {out / 'ray_logs'}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
        time.sleep(5)
        left = sorted(set(os.listdir("/dev/shm")) - shm_before)
        print(f"/dev/shm entries left after the stop: {left or 'none'}", flush=True)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/overload_multinode"),
                  float(sys.argv[2]) if len(sys.argv) > 2 else 600.0))
