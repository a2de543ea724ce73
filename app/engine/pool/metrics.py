"""The pool mode's metrics: one node's KV pool, read as metric families.

Every engine replica on a node sends its node's (:meth:`PoolHandover.node_state`), and the
Metrics deployment exports them labelled by ``node`` and ``pool`` without knowing the mode.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from prefillshare.app.engine.handover import Family, NodeState

if TYPE_CHECKING:
    from prefillshare.app.engine.pool.kv_pool import KVPool

__all__ = ["PoolState", "pool_families"]


def pool_families(pool: KVPool) -> list[Family]:
    """The pool's state, and the counters every engine on the node keeps in the pool's index
    (hits, misses, bytes moved, load time, evictions, fallbacks by reason) under the engine's
    scope (prefill module or decoder name)."""
    total = pool.stats()
    scoped = {s: pool.stats(s).counters for s in pool.scopes()}
    families: list[Family] = [(name, doc, "gauge", [(name, {}, float(value))]) for name, value, doc in (
        ("prefillshare_kv_pool_capacity_bytes", total.capacity_bytes, "Pool byte capacity"),
        ("prefillshare_kv_pool_held_bytes", total.bytes_held, "Bytes of KV blocks held"),
        ("prefillshare_kv_pool_blocks", total.blocks, "KV blocks held"),
        ("prefillshare_kv_pool_pinned_blocks", total.pinned_blocks, "Blocks pinned for pending fan-out loads"),
    )]
    events = [("prefillshare_kv_pool_events_total",
               {"scope": scope or "pool", "event": re.sub(r"[^a-zA-Z0-9_:]", "_", event)}, float(value))
              for scope, counters in sorted(scoped.items()) for event, value in sorted(counters.items())]
    families.append(("prefillshare_kv_pool_events", "Connector/pool counters by engine scope", "counter", events))
    hits, misses = total.get("hits"), total.get("misses")
    if hits + misses:
        name = "prefillshare_kv_pool_request_hit_ratio"
        families.append((name, "Decoder lookups that found the whole shared prefix / all lookups", "gauge",
                         [(name, {}, hits / (hits + misses))]))
    return families


class PoolState(NodeState):
    """A reader's handle on the node's pool at ``path``, opened on first use (its creator may
    still be starting)."""

    label = "pool"

    def __init__(self, path: str) -> None:
        self.source = path
        self._pool: KVPool | None = None

    def families(self) -> list[Family]:
        if self._pool is None:
            from prefillshare.app.engine.pool.kv_pool import KVPool

            self._pool = KVPool.attach(self.source)
        return pool_families(self._pool)
