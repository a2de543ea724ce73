"""Node-affinity request router for DecodeServer deployments.

A decoder replica on the node where the prompt's KV was prefilled reads it from that node's
shared-memory pool; any other replica first pulls it across nodes (NIXL). So a decode request
carries the prefill replica's node id (``DecodeRequest.prefer_node``) and goes to a replica on
that node when one exists, unless that replica has ``imbalance_threshold`` more ongoing
requests than the least loaded one: then load wins, because a pull costs less than a queue.
On one node every replica is on the prefill's node, so this is least-loaded routing.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ray.serve.request_router import PendingRequest, RunningReplica

from prefillshare.app.config import RoutingConfig, default
from prefillshare.deployments.routing.safe_router import SafeRouter


def rank_by_node(
    replicas: Sequence[tuple[str, str | None]],
    prefer_node: str | None,
    queue_len: Callable[[str], int],
    imbalance_threshold: int,
) -> list[list[str]]:
    """Ranked tiers of replica ids from ``(replica id, node id)`` pairs.

    Same-node replicas (least loaded first), then the others by load; one tier by load when
    no node is preferred, none of the replicas is on it, or the same-node ones are overloaded.
    """
    by_load = [r for r, _ in sorted(replicas, key=lambda rn: (queue_len(rn[0]), random.random()))]
    if not by_load or prefer_node is None:
        return [by_load] if by_load else []
    nodes = dict(replicas)
    local = [r for r in by_load if nodes[r] == prefer_node]
    if not local or queue_len(local[0]) - queue_len(by_load[0]) >= imbalance_threshold:
        return [by_load]
    return [local, [r for r in by_load if r not in local]]


def preferred_node(pending: PendingRequest | None) -> str | None:
    """The node a DecodeRequest (first positional argument) asks for."""
    if pending is None or not pending.args:
        return None
    return getattr(pending.args[0], "prefer_node", None)


class NodeAffinityRouter(SafeRouter):
    """Serve request router: same node as the prefill first, load fallback."""

    def initialize_state(self, metrics_deployment: str | None = None, *,
                         imbalance_threshold: int = default(RoutingConfig, "imbalance_threshold"), **kwargs):
        super().initialize_state(metrics_deployment, **kwargs)
        self.imbalance_threshold = int(imbalance_threshold)

    def rank(self, candidates: list[RunningReplica], pending: PendingRequest | None,
             queue_len: dict[str, int]) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidates}
        tiers = rank_by_node([(rid, r.node_id) for rid, r in by_id.items()], preferred_node(pending),
                             lambda rid: queue_len.get(rid, 0), self.imbalance_threshold)
        return [[by_id[r] for r in tier] for tier in tiers]
