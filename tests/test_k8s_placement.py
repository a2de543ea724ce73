"""The rendered GPU RayService's placement, scheduled by real Ray.

A local multi-node Ray cluster mirrors the manifest: one raylet per pod at the group's
initial `replicas`, each started with the CPUs/GPUs of its pod and the custom resource its
`rayStartParams` hand to `ray start` (parsed as bash would). Every replica's
placement-group bundles from the rendered Serve config are then placed by Ray's scheduler:
all must fit, every engine replica on a GPU of its own in a GPU-node pod, and a prefill replica
in the same pod as a replica of every decoder (its pulls stay device to device: CUDA IPC).
GPUs are Ray's logical resources here (no device needed).
Run through scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from prefillshare.app.config import load_config
from prefillshare.app.kube.capacity import cluster_pools

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_manifest() -> dict:
    return yaml.safe_load((REPO / "k8s" / "rayservice-gpu.yaml").read_text())


@pytest.fixture(scope="module")
def cluster(gpu_manifest):
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_TMPDIR"] = f"/tmp/rk8s{os.getpid()}"
    pools = {p.name: p for p in cluster_pools(gpu_manifest)}
    groups = {g["groupName"]: g for g in gpu_manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    head = pools["head"].per_pod

    def start() -> tuple[Cluster, dict]:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": int(head["CPU"]), "num_gpus": 0})
        node_group = {}
        try:
            for name, g in groups.items():
                per_pod = pools[name].per_pod
                custom = {k: v for k, v in per_pod.items() if k not in ("CPU", "GPU")}
                for _ in range(g["replicas"]):
                    node = c.add_node(num_cpus=int(per_pod["CPU"]), num_gpus=int(per_pod["GPU"]), resources=custom)
                    node_group[node.node_id] = name
            ray.init(address=c.address)
            c.wait_for_nodes()
        except Exception:
            ray.shutdown()
            c.shutdown()
            raise
        return c, node_group

    for attempt in range(5):  # raylets have a fixed 30 s to register; a saturated machine can miss it
        try:
            c, node_group = start()
            break
        except Exception:  # noqa: BLE001 - retried, then raised
            if attempt == 4:
                raise
    yield node_group
    ray.shutdown()
    c.shutdown()


def test_every_replica_lands_on_its_group(gpu_manifest, cluster):
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    node_group = cluster
    serve = yaml.safe_load(gpu_manifest["spec"]["serveConfigV2"])
    cfg = load_config(serve["applications"][0]["args"]["config"])
    placed: dict[str, list[str]] = {}
    pgs = []
    for kind, items in (("prefill", cfg.prefill_modules), ("decode", cfg.decoders)):
        for item in items:
            pl = item.placement
            assert pl.placement_group_bundles, f"{item.name}: GPU placement needs explicit bundles"
            for _ in range(pl.start_replicas):  # what Serve starts; the Ray autoscaler adds pods beyond
                pg = placement_group(pl.placement_group_bundles, strategy=pl.placement_group_strategy)
                assert pg.wait(timeout_seconds=60), f"{kind}:{item.name} does not fit the cluster"
                pgs.append((f"{kind}:{item.name}", pg))
                nodes = set(placement_group_table(pg)["bundles_to_node_id"].values())
                placed.setdefault(f"{kind}:{item.name}", []).extend(node_group[n] for n in nodes)
    assert {g for groups in placed.values() for g in groups} == {"gpu-node"}, placed
    bundles = [(name, n) for name, pg in pgs for n in placement_group_table(pg)["bundles_to_node_id"].values()]
    gpus = sum(int(b.get("GPU", 0)) for _, pg in pgs for b in pg.bundle_specs)
    assert gpus == len(bundles), "one GPU per engine replica"
    decoders = {f"decode:{d.name}" for d in cfg.decoders}
    for name, node in bundles:
        if name.startswith("prefill:"):
            beside = {n for n, other in bundles if other == node}
            assert decoders <= beside, f"{name} on {node}: decoders {sorted(decoders - beside)} are in other pods"
    per_pod = int(next(p for p in cluster_pools(gpu_manifest) if p.name == "gpu-node").per_pod["GPU"])
    free = per_pod * len(set(node_group)) - gpus
    extra = placement_group([{"GPU": 1, "gpu_node": 1}] * (free + 1), strategy="PACK")
    assert not extra.wait(timeout_seconds=3), "more GPUs placed than the pods hold"
    for pg in [pg for _, pg in pgs] + [extra]:
        remove_placement_group(pg)
