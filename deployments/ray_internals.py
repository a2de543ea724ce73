"""The private Ray Serve APIs and settings the project uses, and why; nothing else in the project names them.

``ray[serve]`` is pinned (pyproject.toml) because of what is here. tests/test_ray_internals.py
checks each name against the installed Ray without a cluster and fails on an upgrade that
moves or reshapes one; after an upgrade, fix this module and that test, nothing else.

- ``DeploymentResponse._to_object_ref()``: resolves once a replica has taken the call. A
  prefill fan-out bounds that wait (``limits.prefill_wait_s``): when a prefill module's node is
  gone, Serve holds the call with no replica to give it to, and the decoders should prefill
  privately instead of waiting. The public ``await response`` bounds the whole call, not the
  wait for a replica.
- ``RequestRouter._fulfill_next_pending_request`` with ``_pending_requests_by_id``,
  ``_record_queue_wait_time`` and ``_remove_pending_request_from_indices``: the base router hands
  a chosen replica to the request indexed under the routing request's internal id, which several
  calls made while serving one request share; a locality router's replica must go to the request
  it was chosen for (deployments/routing/safe_router.py, cause 1). :class:`ChosenReplicaRouter` overrides
  it and asks its subclass which request that is.
- ``RequestRouter._deployment_id``: the deployment's name, for log lines and metrics labels.
- ``DeploymentResponseGenerator._fetch_future_result_async()``: resolves once a replica has taken
  a streaming call (the stream then reads on from it). A decoder call bounds that wait while the
  decoder has no replica running (``limits.decoder_wait_s``); ``_to_object_ref_gen`` would do
  the same but needs the call made by reference.
- ``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD`` and ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP``
  (read by ``ray.serve._private.constants``), both "0" in every request-path replica's env
  (:data:`REPLICA_ENV`): Serve then runs the replica's code and its handles' routers on the
  replica's main event loop instead of a thread and a loop of their own, and each call on a
  request's path (Router -> prefill -> Router -> decoder, one streamed chunk at a time) skips two
  hand-offs between threads. They are the two of Serve's ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` set
  that leave its HTTP proxy and ports as they are. Measured on 2 cores in six back-to-back pairs of runs:
  the follow-on completion's median first token lower in five (mean 12.5 ms), per-token time
  too (docs/benchmarks.md "First token of a follow-on completion").
- ``RAY_SERVE_ENABLE_DIRECT_INGRESS`` (experimental in Ray 2.60; read by the controller and the
  replicas) and the settings beside it, in the env of a cluster started with it
  (:func:`direct_ingress_env`): the Router replica also serves HTTP on a port of its own, so a
  client skips Serve's proxy and its hop to the Router; the proxy stays on ``http_options.port``.
  Its ports start at the one given (``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT``; one Router replica
  gets that one), a replacement Router takes its predecessor's port back at once
  (``RAY_SERVE_PORT_QUARANTINE_S`` 0: Serve holds a freed port for minutes by default, for its
  HAProxy mode), and a stop does not wait the 30 s Serve leaves an outside load balancer
  (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`` 0). Measured on 2 cores: the follow-on
  completion's median first token 8-21 ms lower than through the proxy (docs/benchmarks.md).
  :func:`direct_ingress_urls` reads the Router's port from the controller's target groups
  (``get_serve_details()`` of ``serve.context._get_global_client()``).
- The controller's ``get_serve_instance_details`` (``_controller`` of the same client), awaited
  rather than ``ray.get`` so that a Router's event loop does not block on it:
  :func:`deployment_details` gives each deployment's ``target_num_replicas`` (the autoscaler's
  target) and its replicas' states and start times, which deployments/fleet.py reads. Serve has no
  public call that gives the target.
"""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

__all__ = ["REPLICA_ENV", "ChosenReplicaRouter", "deployment_details", "direct_ingress_env", "direct_ingress_urls",
           "replica_assigned", "stream_assigned"]

REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def direct_ingress_env(first_port: int) -> dict[str, str]:
    """The env of a cluster whose ingress replicas serve HTTP on ports from ``first_port`` (Serve's direct ingress)."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first_port + 99),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0", "RAY_SERVE_PORT_QUARANTINE_S": "0"}


def direct_ingress_urls(app_name: str) -> list[str]:
    """``http://ip:port`` of each running ingress replica of ``app_name`` that serves HTTP on its own
    port (Serve's direct ingress); [] when direct ingress is off. Needs a connected Serve client."""
    from ray.serve.context import _get_global_client

    groups = _get_global_client().get_serve_details().get("target_groups", [])
    return [f"http://{t['ip']}:{t['port']}" for g in groups
            if g.get("app_name") == app_name and g.get("ingress_deployment_name") and g.get("protocol") == "HTTP"
            for t in g.get("targets", [])]


async def deployment_details(app_name: str) -> dict[str, dict[str, Any]]:
    """{deployment: its details as Serve's ``DeploymentDetails`` dumps them} of ``app_name`` (keys read:
    ``target_num_replicas``, ``replicas`` with ``state`` and ``start_time_s``); {} while the
    application is not known to the controller."""
    from ray.serve.context import _get_global_client

    details = await _get_global_client()._controller.get_serve_instance_details.remote()
    return (details.get("applications", {}).get(app_name) or {}).get("deployments", {})


async def replica_assigned(response) -> Any:
    """The ObjectRef of a ``DeploymentResponse``, available once a replica has accepted the call."""
    return await response._to_object_ref()


async def stream_assigned(stream) -> None:
    """Returns once a replica has accepted the call of ``stream`` (a ``DeploymentResponseGenerator``)."""
    await stream._fetch_future_result_async()


class ChosenReplicaRouter(RequestRouter):
    """A RequestRouter that gives a chosen replica to the request :meth:`chosen_request` names."""

    def chosen_request(self, request_metadata) -> PendingRequest | None:
        """The pending request the current routing task chose a replica for; None: Serve's own pick."""
        return None

    @property
    def deployment_name(self) -> str:
        return self._deployment_id.name

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        pending = self.chosen_request(request_metadata)
        if pending is None or pending.metadata is not request_metadata:
            super()._fulfill_next_pending_request(replica, request_metadata)
            return
        if pending.future.done():  # cancelled meanwhile: the routing loop moves on
            return
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        if self._pending_requests_by_id.get(request_metadata.internal_request_id) is pending:
            self._remove_pending_request_from_indices(pending)


if __name__ == "__main__":  # scripts/serve.sh: `eval "$(python -m prefillshare.deployments.ray_internals direct-ingress-env PORT)"`
    import shlex
    import sys

    if sys.argv[1:2] != ["direct-ingress-env"] or len(sys.argv) != 3:
        sys.exit("usage: python -m prefillshare.deployments.ray_internals direct-ingress-env FIRST_PORT")
    for k, v in direct_ingress_env(int(sys.argv[2])).items():
        print(f"export {k}={shlex.quote(v)}")
