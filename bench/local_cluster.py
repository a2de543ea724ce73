"""A three-raylet Ray cluster on this machine: the head (Serve's controller, proxy and ingress
deployments), a prefill node and a decode node with the custom resources the KubeRay worker
groups give their pods. The multi-node tests (tests/test_serve_vllm_nixl.py) run on it; one
machine's raylets share its cores, so it shows behaviour across nodes, not a cluster's capacity."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_cluster(prefill_node: dict, decode_node: dict, attempts: int = 4, log_to_driver: bool = True):
    """``(cluster, {"head" | "prefill" | "decode": node id})`` with this process connected (raylet temp
    dir: ``RAY_TMPDIR``). ``prefill_node`` / ``decode_node`` are ``Cluster.add_node`` arguments.
    Retried: Ray gives a raylet a fixed 30 s to register, which a busy 2-core box can miss."""
    import ray
    from ray.cluster_utils import Cluster

    for attempt in range(attempts):
        c = None
        try:
            c = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 2, "include_dashboard": False,
                # a raylet starved by other jobs on this box must not be declared dead (default 5 misses)
                # and Ray's own memory monitor counts the other jobs' memory on this shared machine
                # and kills our workers at 95% of it (the kernel's OOM killer still applies)
                "_system_config": {"health_check_failure_threshold": 10, "memory_monitor_refresh_ms": 0}})
            prefill = c.add_node(**prefill_node)
            decode = c.add_node(**decode_node)
            ray.init(address=c.address, log_to_driver=log_to_driver)
            c.wait_for_nodes()
            return c, {"head": c.head_node.node_id, "prefill": prefill.node_id, "decode": decode.node_id}
        except Exception:  # noqa: BLE001 - retried, then raised
            ray.shutdown()
            if c is not None:
                c.shutdown()
            if attempt == attempts - 1:
                raise
