"""A local three-raylet Ray cluster for the multi-node tests: the head (Serve's controller, proxy
and ingress deployments), a prefill node advertising ``prefill_node`` and a decode node
advertising ``decode_node``, the custom resources the KubeRay worker groups give their pods."""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import urllib.error
import urllib.request

PREFILL_NODE = {"num_cpus": 0, "resources": {"prefill_node": 1, "beta_slot": 1}}
DECODE_NODE = {"num_cpus": 0, "resources": {"decode_node": 1, "beta_slot": 1}}


class ServingCluster:
    """The started raylets (``cluster``, ``nodes``: role -> node id) and Serve on them."""

    def __init__(self, cluster, nodes: dict[str, str]):
        self.cluster, self.nodes = cluster, nodes

    def serve(self, apps: dict) -> str:
        """Serve's one proxy on the head (``HeadOnly``: every raylet here shares the machine's
        ports); ``apps`` (name -> (application, route prefix)) run and ready. Returns the URL."""
        from ray import serve

        from bench.local_cluster import free_port

        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        for name, (application, prefix) in apps.items():
            serve.run(application, name=name, route_prefix=prefix)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, set(apps))
        return url


@contextlib.contextmanager
def serving_cluster(tag: str, dirs: tuple[str, ...] = ()):
    """The three raylets for one test module; afterwards Serve, Ray and the cluster are shut down
    and ``dirs`` (the apps' pool folders) and the raylets' temp dir removed, however it ended."""
    import ray
    from ray import serve

    from bench.local_cluster import start_local_cluster

    tmp = f"/tmp/r{tag}{os.getpid()}"
    os.environ["RAY_TMPDIR"] = tmp
    try:
        cluster, nodes = start_local_cluster(PREFILL_NODE, DECODE_NODE)
        try:
            yield ServingCluster(cluster, nodes)
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def replica_nodes() -> dict[str, set[str]]:
    """Live Serve replicas by deployment -> the node ids they run on (from the GCS actor table)."""
    import ray

    out: dict[str, set[str]] = {}
    for a in ray._private.state.actors().values():
        cls = a.get("ActorClassName", "")
        if cls.startswith("ServeReplica:") and a.get("State") == "ALIVE":
            out.setdefault(cls.split(":", 2)[2], set()).add(a["Address"]["NodeID"])
    return out


def get(url: str, timeout: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e).encode()


def wait_ready(base: str, apps: set[str]) -> None:
    """Every application in ``apps`` running (each replica placed and started) and /ready 200."""
    from ray import serve

    for _ in range(600):  # waiting for engine start-up, not a timing assertion
        status = serve.status().applications
        if apps <= set(status) and all(a.status == "RUNNING" for a in status.values()) \
                and get(base + "/ready")[0] == 200:
            return
        time.sleep(1)
    raise AssertionError(f"/ready never returned 200: {get(base + '/ready')}")
