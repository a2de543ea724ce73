"""Prefix-locality request router for PrefillServer deployments.

Prefill requests for *different* decoders over the same context should land on the same
prefill replica: that replica already holds the context's blocks in its prefix cache, so it
computes only each agent's suffix. Each handle (Router, Orchestrator) has its own router
instance, so the choice must agree across processes without shared state: a request goes to
the replica with the highest rendezvous hash of its first block key (every caller computes
the same), refined by the longest block-key match this router has seen (recorded when it ranks a
call, so the calls of one fan-out, which arrive together, follow the first). When that replica
has `imbalance_threshold` more ongoing requests than the least loaded one (4x that when this
router saw it take most of the prompt's blocks), the request falls back to load balancing
(counted as a fallback with reason "prefill_overloaded").
"""
from __future__ import annotations

import hashlib
import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ray.serve.request_router import PendingRequest, RunningReplica

from prefillshare.app.config import RoutingConfig, default
from prefillshare.deployments.routing.safe_router import SafeRouter

log = logging.getLogger("ray.serve")
# how many times imbalance_threshold a replica known to hold most of a prompt's blocks may carry
CACHED_TOLERANCE = 4


def rendezvous_rank(key: str, replica_ids: Sequence[str]) -> list[str]:
    """Replica ids ordered by highest-random-weight hash of ``key`` (stable across processes)."""
    return sorted(replica_ids, key=lambda r: hashlib.sha256(f"{key}|{r}".encode()).digest(), reverse=True)


class LocalityTable:
    """Which replica last served a block key; bounded LRU. Pure, testable without Ray."""

    def __init__(self, capacity: int = default(RoutingConfig, "max_tracked_prefixes")):
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()

    def longest_match(self, keys: Sequence[str], alive: set[str]) -> tuple[str | None, int]:
        """(replica holding the deepest known key among ``alive``, matched depth in blocks)."""
        for depth in range(len(keys), 0, -1):
            rid = self._owner.get(keys[depth - 1])
            if rid is not None and rid in alive:
                self._owner.move_to_end(keys[depth - 1])
                return rid, depth
        return None, 0

    def record(self, keys: Sequence[str], replica_id: str) -> None:
        for k in keys:
            self._owner[k] = replica_id
            self._owner.move_to_end(k)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        for k in [k for k, r in self._owner.items() if r == replica_id]:
            del self._owner[k]


def choose(
    keys: Sequence[str],
    replica_ids: Sequence[str],
    queue_len: Callable[[str], int],
    table: LocalityTable,
    imbalance_threshold: int,
) -> tuple[list[list[str]], str | None]:
    """Ranked tiers of replica ids for a request, and a fallback reason (or None).

    Locality first (deepest known key, else rendezvous on the first key); the rest follow by
    load. Without keys (a prompt shorter than one block) there is nothing to keep local:
    least loaded first.
    """
    ids = list(replica_ids)
    if not ids:
        return [], None
    by_load = sorted(ids, key=lambda r: (queue_len(r), random.random()))
    if not keys:
        return [by_load], None
    preferred, depth = table.longest_match(keys, set(ids))
    if preferred is None:
        preferred = rendezvous_rank(keys[0], ids)[0]
    # A replica known to hold most of the prompt's blocks computes only its tail; anywhere else the
    # whole prompt is computed again. So it tolerates more in flight before the request moves: the
    # calls of one fan-out (an in-engine decoder's are one call per agent) stay together.
    threshold = imbalance_threshold * (CACHED_TOLERANCE if 2 * depth >= len(keys) else 1)
    if queue_len(preferred) - queue_len(by_load[0]) >= threshold:
        return [by_load], "prefill_overloaded"
    return [[preferred], [r for r in by_load if r != preferred]], None


def request_keys(pending: PendingRequest | None) -> tuple[str, ...]:
    """The locality keys a PrefillRequest carries (first positional argument)."""
    if pending is None or not pending.args:
        return ()
    return tuple(getattr(pending.args[0], "locality_keys", ()) or ())


class PrefixLocalityRouter(SafeRouter):
    """Serve request router: prefix locality on prefill module block keys, load fallback."""

    def initialize_state(self, metrics_deployment: str | None = None, *,
                         imbalance_threshold: int = default(RoutingConfig, "imbalance_threshold"),
                         max_tracked_prefixes: int = default(RoutingConfig, "max_tracked_prefixes"), **kwargs):
        super().initialize_state(metrics_deployment, **kwargs)
        self.imbalance_threshold = int(imbalance_threshold)
        self.table = LocalityTable(int(max_tracked_prefixes))

    def rank(self, candidates: list[RunningReplica], pending: PendingRequest | None,
             queue_len: dict[str, int]) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidates}
        keys = request_keys(pending)
        tiers, reason = choose(keys, list(by_id), lambda rid: queue_len.get(rid, 0), self.table,
                               self.imbalance_threshold)
        if reason:
            self._count_fallback(reason)
        elif keys and tiers:
            # recorded now, not only once it lands: a fan-out's calls come together (an in-engine decoder's
            # are one per agent), and the ones ranked before this one lands must see where its blocks go,
            # else a replica busy with the fan-out itself looks merely loaded and a call leaves it, to
            # compute the whole context again elsewhere
            self.table.record(keys, tiers[0][0])
        return [[by_id[r] for r in tier] for tier in tiers]

    def routed(self, pending: PendingRequest, replica_id: str) -> None:
        keys = request_keys(pending)
        if keys:
            self.table.record(keys, replica_id)

    def on_replica_actor_died(self, replica_id) -> None:
        self.table.forget(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)

    def _count_fallback(self, reason: str) -> None:
        handle = self.metrics_handle()
        try:
            if handle is not None:
                handle.fallback.remote(reason, 1)
        except Exception as e:  # noqa: BLE001 - metrics are best effort
            log.debug("could not count a routing fallback: %s", e)
