"""The connector's worker half without an engine: CPU KV caches shaped as vLLM's CPU attention
keeps them, a producer worker saving a request's blocks and a consumer worker loading them,
over a real node pool (bytes, partial block, fan-out pins, a torn slot)."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from prefillshare.app.engine.cpu_layout import BlockLayout
from prefillshare.app.engine.pool.connector.metadata import ConnectorSettings, LoadSpec, PrefillShareMeta, SaveSpec
from prefillshare.app.engine.pool.connector.worker import ShareWorker
from prefillshare.app.engine.pool.kv_keys import shared_block_keys
from tests.kv_blocks import temp_pool

BS, HEADS, HEAD, LAYERS, NB = 16, 2, 32, 3, 8
CFG = NS(kv_cache_groups=[NS(kv_cache_spec=NS(num_kv_heads=HEADS, head_size=HEAD))], num_blocks=NB)


@pytest.fixture
def pool():
    with temp_pool(4 << 20) as p:
        yield p


def worker(pool, role, seed=None):
    w = ShareWorker(ConnectorSettings(role, "base-A", pool.spec, role), pool, BS, CFG, None)
    g = torch.Generator().manual_seed(seed or 0)
    caches = {f"layer.{i}": (torch.randn((NB, HEADS, BS, 2 * HEAD), generator=g) if seed else
                             torch.zeros((NB, HEADS, BS, 2 * HEAD))) for i in range(LAYERS)}
    w.register_kv_caches(caches)
    return w


def test_a_saved_request_loads_bit_for_bit_and_consumes_one_fan_out_pin(pool):
    producer, consumer = worker(pool, "producer", seed=3), worker(pool, "consumer")
    keys = shared_block_keys("base-A", "t", list(range(38)), BS)  # 37 shared tokens: 16 + 16 + 5
    producer.wait_for_save(PrefillShareMeta(saves=[SaveSpec("p", [k.key for k in keys], [k.num_tokens for k in keys],
                                                            [3, 1, 6], pins=2)]))
    assert [pool.pins(k.key) for k in keys] == [2, 2, 2]
    entries = pool.find([k.key for k in keys])
    consumer.start_load_kv(PrefillShareMeta(loads=[LoadSpec("c", entries, [0, 2, 4], pool.lease(entries),
                                                            [k.key for k in keys], 5)]))
    assert consumer.get_block_ids_with_load_errors() == set()
    src, dst = producer.layout, consumer.layout
    assert torch.equal(dst.gather(0), src.gather(3)) and torch.equal(dst.gather(2), src.gather(1))
    ref = BlockLayout([torch.zeros_like(c) for c in dst.caches], BS, HEADS, HEAD, dst.layout)
    ref.scatter(src.gather(6), 4, 5)  # the partial block: its first 5 tokens only
    assert torch.equal(dst.gather(4), ref.gather(4))
    assert [pool.pins(k.key) for k in keys] == [1, 1, 1]
    assert pool._db().execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0
    st = pool.stats("consumer")
    assert st.get("loads") == 1 and st.get("load_tokens") == 37 and st.get("loaded_blocks") == 3


def test_a_torn_slot_fails_the_whole_load_and_is_dropped(pool):
    producer, consumer = worker(pool, "producer", seed=4), worker(pool, "consumer")
    keys = shared_block_keys("base-A", "t", list(range(33)), BS)
    producer.wait_for_save(PrefillShareMeta(saves=[SaveSpec("p", [k.key for k in keys], [16, 16], [0, 1], 0)]))
    entries = pool.find([k.key for k in keys])
    pool.slab(entries[1].slab).set_gen(entries[1].slot, entries[1].gen - 1)  # a writer that never finished
    consumer.start_load_kv(PrefillShareMeta(loads=[LoadSpec("c", entries, [5, 6], pool.lease(entries))]))
    assert consumer.get_block_ids_with_load_errors() == {5, 6}  # every block: vLLM recomputes from token 0
    assert pool.stats("consumer").fallbacks == {"torn": 1} and pool.entry(keys[1].key) is None
    assert not consumer.layout.caches[0][5:7].any()  # nothing was copied in
