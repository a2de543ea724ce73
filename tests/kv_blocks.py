"""Blocks from bytes, for pool tests: stored and read through the API the connector uses
(reserve / publish, check_entries / verify around a copy)."""
from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prefillshare.app.engine.pool.kv_pool import BlockEntry, KVPool, PoolSpec


@dataclass(frozen=True)
class Block:
    key: str
    data: bytes
    ntokens: int
    layout: str
    depth: int = 0  # block index in its chain: eviction takes deeper blocks first


def put(pool: KVPool, blocks: Sequence[Block], pins: int = 0, scope: str = "") -> list[bool]:
    """Store blocks of one size as a producer does; per block, whether it is in the pool afterwards."""
    res = pool.reserve([b.key for b in blocks], len(blocks[0].data), [b.ntokens for b in blocks], blocks[0].layout,
                       pins, scope, depths=[b.depth for b in blocks])
    for e, b in zip(res.entries, blocks):
        if e is not None:
            pool.slab(e.slab).view(e.slot)[: e.nbytes] = b.data
    pool.publish(res)
    return res.stored


def read(pool: KVPool, entry: BlockEntry) -> bytes:
    """A copy of a block's bytes, checked as a consumer checks them."""
    pool.check_entries([entry])
    pool.verify([entry])
    data = bytes(pool.view(entry))
    pool.check_entries([entry])
    return data


@contextlib.contextmanager
def temp_pool(capacity_bytes: int) -> Iterator[KVPool]:
    """A fresh pool in /dev/shm, removed afterwards."""
    path = f"/dev/shm/ps-test-{uuid.uuid4().hex[:8]}"
    try:
        yield KVPool(PoolSpec(path, capacity_bytes=capacity_bytes))
    finally:
        shutil.rmtree(path, ignore_errors=True)
