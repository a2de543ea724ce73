"""The private Ray Serve APIs of deployments/ray_internals.py, checked against the installed Ray
(no cluster): a Ray upgrade that renames or reshapes one fails here, not in a running app. And
no other project module names a private Ray Serve API."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from prefillshare.deployments import ray_internals
from prefillshare.deployments.routing.safe_router import SafeRouter

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("app", "deployments", "agents", "scripts") for p in sorted((ROOT / d).rglob("*.py"))]


def test_to_object_ref_is_a_coroutine_without_arguments():
    fn = DeploymentResponse._to_object_ref
    assert inspect.iscoroutinefunction(fn)
    assert list(inspect.signature(fn).parameters) == ["self"]


def test_a_streams_wait_for_its_replica_is_a_coroutine_that_caches_the_result():
    fn = DeploymentResponseGenerator._fetch_future_result_async
    assert inspect.iscoroutinefunction(fn)
    assert list(inspect.signature(fn).parameters) == ["self"]
    # the stream reads on from the replica this wait resolved to (the cached result)
    assert "_fetch_future_result_async" in inspect.getsource(DeploymentResponseGenerator.__anext__)
    assert "self._replica_result" in inspect.getsource(fn)


def test_curr_replicas_is_the_public_replica_view_of_a_router():
    assert isinstance(inspect.getattr_static(RequestRouter, "curr_replicas"), property)


def test_fulfill_next_pending_request_keeps_its_signature():
    params = list(inspect.signature(RequestRouter._fulfill_next_pending_request).parameters)
    assert params == ["self", "replica", "request_metadata"]
    # the override must be the one Serve's routing loop calls
    src = inspect.getsource(RequestRouter)
    assert "self._fulfill_next_pending_request(" in src


def test_pending_request_indices_and_wait_time_exist():
    init = inspect.getsource(RequestRouter.__init__)
    assert re.search(r"self\._pending_requests_by_id\b.*=", init)
    assert re.search(r"self\._deployment_id\s*=", init)
    assert list(inspect.signature(RequestRouter._remove_pending_request_from_indices).parameters) == [
        "self", "pending_request"]
    assert list(inspect.signature(RequestRouter._record_queue_wait_time).parameters) == ["self", "pending_request"]
    remove = inspect.getsource(RequestRouter._remove_pending_request_from_indices)
    assert "internal_request_id" in remove and "_pending_requests_by_id" in remove


def test_pending_request_carries_what_the_routers_read():
    fields = set(getattr(PendingRequest, "__dataclass_fields__", {}))
    assert {"args", "metadata", "future", "routing_context"} <= fields
    from ray.serve._private.common import RequestMetadata

    assert "internal_request_id" in RequestMetadata.__dataclass_fields__


def test_safe_router_overrides_through_the_compat_module():
    assert issubclass(SafeRouter, ray_internals.ChosenReplicaRouter)
    assert "_fulfill_next_pending_request" not in vars(SafeRouter)


def _ray_private_names() -> set[str]:
    """Single-underscore attribute names of the Ray Serve classes the project touches."""
    names: set[str] = set()
    for cls in (RequestRouter, DeploymentResponse, DeploymentResponseGenerator, DeploymentHandle, PendingRequest,
                RunningReplica):
        for klass in cls.__mro__:
            if klass.__module__.startswith("ray."):
                names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
                try:
                    src = inspect.getsource(klass)
                except (OSError, TypeError):
                    continue
                names |= set(re.findall(r"self\.(_[a-z]\w*)\s*[:=]", src))
    return names


def test_private_ray_serve_names_appear_only_in_the_compat_module():
    private = _ray_private_names()
    assert "_to_object_ref" in private and "_pending_requests_by_id" in private  # the scan sees Ray's names
    offenders = []
    for path in SOURCES:
        if path.name == "ray_internals.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("ray.serve._private", "ray._private")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.startswith(("ray.serve._private", "ray._private"))
                                                       for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports a private Ray module")
            elif isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self" and _own_attr(path, node.attr)):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} uses .{node.attr}")
    assert not offenders, offenders


def _own_attr(path: Path, attr: str) -> bool:
    """``self.<attr>`` assigned in the same file: the project's own attribute that shares a name."""
    return re.search(rf"self\.{attr}\s*(:[^=]+)?=[^=]", path.read_text()) is not None


def test_the_replica_env_names_are_the_ones_serve_reads():
    """Serve reads both settings when a replica's process imports it: with REPLICA_ENV set they
    are off, without it they keep Serve's defaults (on). A Ray upgrade that renames one fails here."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from ray.serve._private import constants as c; print(json.dumps("
            "[c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, c.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP]))")
    # Serve's throughput-optimized switch would change both defaults: the "without" case is without it too
    clean = {k: v for k, v in os.environ.items()
             if k not in ray_internals.REPLICA_ENV and k != "RAY_SERVE_THROUGHPUT_OPTIMIZED"}

    def read(env):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert read(clean) == [True, True]
    assert read({**clean, **ray_internals.REPLICA_ENV}) == [False, False]


def test_request_path_replicas_get_the_replica_env_and_an_engines_own_env_wins():
    from prefillshare.app.config import load_config
    from prefillshare.deployments.application import _small, engine_options

    cfg = load_config(ROOT / "serve_config.yaml")
    dec = cfg.decoders[0]
    env = engine_options(cfg, "x", dec.placement, dec.engine)["ray_actor_options"]["runtime_env"]["env_vars"]
    assert ray_internals.REPLICA_ENV.items() <= env.items()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == dec.engine.threads_bind  # the engine's own env is still there
    small = _small(cfg, cfg.router)["ray_actor_options"]["runtime_env"]["env_vars"]
    assert small == ray_internals.REPLICA_ENV
    own = dec.placement.model_copy(update={"env": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}})
    env = engine_options(cfg, "x", own, dec.engine)["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"


def test_the_direct_ingress_env_names_are_the_ones_serve_reads():
    """With direct_ingress_env Serve's constants say direct ingress on, ports from the one given, no
    draining wait and no port quarantine; without it they keep Serve's defaults. And the target
    groups direct_ingress_urls reads still carry the fields it needs."""
    import json
    import os
    import subprocess
    import sys

    from ray.serve.context import _get_global_client  # noqa: F401 - direct_ingress_urls' client; an import error fails here
    from ray.serve.schema import ServeInstanceDetails, Target, TargetGroup

    code = ("import json; from ray.serve._private import constants as c; print(json.dumps("
            "[c.RAY_SERVE_ENABLE_DIRECT_INGRESS, c.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, "
            "c.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT, c.RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, "
            "c.RAY_SERVE_PORT_QUARANTINE_S]))")
    env = ray_internals.direct_ingress_env(8001)
    clean = {k: v for k, v in os.environ.items() if k not in env and k != "RAY_SERVE_THROUGHPUT_OPTIMIZED"}

    def read(e):
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert read({**clean, **env}) == [True, 8001, 8100, 0.0, 0.0]
    off = read(clean)
    assert off[0] is False and off[1] != 8001 and off[3] > 0 and off[4] > 0
    assert "target_groups" in ServeInstanceDetails.model_fields
    assert {"targets", "app_name", "ingress_deployment_name", "protocol"} <= set(TargetGroup.model_fields)
    assert {"ip", "port"} <= set(Target.model_fields)
    from ray.serve._private.client import ServeControllerClient


    assert list(inspect.signature(ServeControllerClient.get_serve_details).parameters) == ["self"]
