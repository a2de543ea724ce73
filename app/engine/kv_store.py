"""The store protocol: what the PrefillShare connector needs from wherever KV blocks are kept.

One implementation ships: :class:`app.engine.kv_pool.KVPool` (this node's shared-memory pool;
across nodes the KV moves with vLLM's NixlConnector instead, hand-over "vllm-nixl"). The connector's scheduler half uses ``find`` / ``lease`` / ``release``
(index reads and one transaction per request), its worker half ``reserve`` / ``publish``
(producer) and ``check_entries`` (consumer); both count through ``add``.

:func:`open_store` is the one place a :class:`PoolSpec` becomes a store.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from app.engine.kv_pool import BlockEntry, KVPool, PoolSpec, Reservation
from app.engine.slab import Slab

__all__ = ["KVStore", "open_store"]


class KVStore(Protocol):
    """Where a node's KV blocks are found, leased, written and fetched (see the module doc)."""

    def find(self, keys: Sequence[str]) -> list[BlockEntry]:
        """Longest leading run of ``keys`` readable on this node now; no side effects."""

    def lease(self, entries: Sequence[BlockEntry]) -> str | None:
        """Protect ``entries`` from eviction until :meth:`release` (or the lease timeout)."""

    def release(self, lease: str | None, consumed: Iterable[str] = ()) -> None:
        """End a lease; each key in ``consumed`` was loaded once (one fan-out pin less)."""

    def reserve(self, keys: Sequence[str], nbytes: int, ntokens: Sequence[int], layout: str, pins: int = 0,
                scope: str = "") -> Reservation:
        """Slots for a chain of new blocks (a producer's save), unreadable until :meth:`publish`."""

    def publish(self, res: Reservation) -> None:
        """The reserved slots are written: make them readable."""

    def check_entries(self, entries: Sequence[BlockEntry]) -> None:
        """Raise SlotTorn / SlotReused unless every slot still holds its entry's bytes."""

    def verify(self, entries: Sequence[BlockEntry]) -> None:
        """Raise BlockDamaged where a slot's checksum fails (check mode only)."""

    def discard(self, keys: Iterable[str]) -> None:
        """Drop blocks found torn or damaged."""

    def slab(self, slot_bytes: int) -> Slab:
        """This process's mapping of the slab of ``slot_bytes`` slots (bytes move through it)."""

    def add(self, scope: str, deltas: Mapping[str, float]) -> None:
        """Add to this process's counters (written with its next transaction)."""

    def flush(self) -> None:
        """Write pending counters now."""

    def flush_soon(self) -> None:
        """Write pending counters shortly, from a background thread."""

    def close(self) -> None:
        """This process is done with the store."""


def open_store(spec: PoolSpec) -> KVStore:
    """The store a connector's pool spec names: the node's pool."""
    return KVPool(spec)
