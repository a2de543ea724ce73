"""Base of the project's Serve request routers: routing never loses a request.

Ray Serve 2.60's RequestRouter can hold a request forever in two ways, both met by this
project's routers (the decode node-affinity router hung agent runs until the client gave up):

1. Serve gives every handle call that a replica makes while serving one request the internal
   id of that request. The base RequestRouter indexes pending requests by that id (only the
   first of several sharing one) and hands a chosen replica to the request indexed under the
   routing request's id. An agent run with two agents on one decoder sends two such calls at
   once; one of them is never handed a replica. Serve's default router does not meet this
   (it fulfils in FIFO order), but a locality router cannot: its replica was chosen for one
   request. Here the replica goes to the request the routing task chose it for.
2. An exception in ``choose_replicas`` ends the routing task, and the request it was routing
   is already off the routing queue: no task takes it up again. Here a subclass's ranking runs
   under a guard; on an exception the request gets Serve's default choice (two random replicas,
   the less loaded wins), logged and counted (``prefillshare_router_failovers_total``).

The hand-over of cause 1 uses private RequestRouter methods: deployments/ray_internals.py.

Each router registers itself as its process's router for its deployment: :func:`running_replicas`
tells the request path whether a deployment has a replica up (deployments/path/serve_engines.py). The
registry lives here, not in a subclass's module: Serve pickles a router's own module by value, so
that module's globals would be a copy in the caller's process.
"""
from __future__ import annotations

import asyncio
import logging
import random
import weakref
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, RunningReplica

from prefillshare.deployments.ray_internals import ChosenReplicaRouter

log = logging.getLogger("ray.serve")

# deployment name -> this process's router for it (Serve makes one per deployment a process calls)
_ROUTERS: weakref.WeakValueDictionary[str, SafeRouter] = weakref.WeakValueDictionary()


def running_replicas(deployment: str) -> int | None:
    """How many replicas of ``deployment`` this process's router can route to now (Serve drops a
    replica once a call to it failed with its death, or the controller reported it gone); None
    while that is not known: this process never called the deployment, or its router has not yet
    heard of any replica (the app is starting)."""
    router = _ROUTERS.get(deployment)
    if router is None or not router.had_replicas:
        return None
    return len(router.curr_replicas)


def default_choice(candidates: Sequence[RunningReplica]) -> list[list[RunningReplica]]:
    """Serve's default policy (power of two choices): two random candidates, one tier; the
    routing loop then takes the one with the shorter queue."""
    return [random.sample(list(candidates), min(2, len(candidates)))] if candidates else []


class SafeRouter(ChosenReplicaRouter):
    """A RequestRouter whose subclasses only rank replicas (``rank``); see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # routing task -> the request it is routing (set when it asks for a choice)
        self._routing: weakref.WeakKeyDictionary[asyncio.Task, PendingRequest] = weakref.WeakKeyDictionary()
        self._metrics_deployment: str | None = None
        self._metrics = None
        self.had_replicas = False  # the controller has reported a replica since this router was made

    def initialize_state(self, metrics_deployment: str | None = None, **_):
        self._metrics_deployment = metrics_deployment
        _ROUTERS[self.deployment_name] = self

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.had_replicas = self.had_replicas or bool(replicas)

    def rank(self, candidates: list[RunningReplica], pending: PendingRequest | None,
             queue_len: dict[str, int]) -> list[list[RunningReplica]]:
        """Ranked tiers of replicas for ``pending``; ``queue_len`` maps replica id -> cached queue length."""
        raise NotImplementedError

    def routed(self, pending: PendingRequest, replica_id: str) -> None:
        """Called once ``pending`` is accepted by ``replica_id``."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            task = asyncio.current_task()
            if task is not None:
                self._routing[task] = pending_request
            # Every tier is tried before backing off; without this the routing loop spins.
            pending_request.routing_context.should_backoff = True
        cache = self.replica_queue_len_cache
        loads = {r.replica_id.unique_id: cache.get(r.replica_id) or 0 for r in candidate_replicas}
        try:
            return self.rank(candidate_replicas, pending_request, loads)
        except Exception as e:  # noqa: BLE001 - any bug in a ranking must not lose the request
            self._failed(e)
            return default_choice(candidate_replicas)

    def chosen_request(self, request_metadata) -> PendingRequest | None:
        """The request this routing task chose a replica for (cause 1 above)."""
        task = asyncio.current_task()
        return self._routing.get(task) if task is not None else None

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        try:
            self.routed(pending_request, replica_id.unique_id)
        except Exception as e:  # noqa: BLE001 - bookkeeping must not fail a request already sent
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        log.warning("%s: request router failed (%s: %s); Serve's default choice instead",
                    self.deployment_name, type(e).__name__, e, exc_info=True)
        self.report_failover(type(e).__name__)

    def report_failover(self, error: str) -> None:
        handle = self.metrics_handle()
        try:
            if handle is not None:
                handle.router_failover.remote(self.deployment_name, error)
        except Exception as e:  # noqa: BLE001 - metrics are best effort
            log.debug("could not count a router failover: %s", e)

    def metrics_handle(self):
        """The Metrics deployment's handle, or None; callers fire and forget (routing never waits on metrics)."""
        if self._metrics is None and self._metrics_deployment:
            try:
                from ray import serve

                self._metrics = serve.get_deployment_handle(self._metrics_deployment, self.app_name)
            except Exception as e:  # noqa: BLE001 - metrics are best effort
                log.debug("no metrics handle for the request router: %s", e)
        return self._metrics
