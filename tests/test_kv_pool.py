"""The node-local KV pool (LRU, leases, fan-out pins, checksums, processes) and the CPU block layout."""
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch

from app.engine.cpu_layout import BlockLayout
from app.engine.kv_keys import block_keys
from app.engine.kv_pool import BlockDamaged, BlockMissing, KVPool, PutItem

BLOCK = 4096


@pytest.fixture
def pool_dir():
    d = f"/dev/shm/ps-test-pool-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def items(n, tag=0, size=BLOCK):
    keys = block_keys("base", f"t{tag}", list(range(n * 4)), 4)
    return [PutItem(k.key, bytes([(tag * 31 + i) % 256]) * size, k.num_tokens, "L") for i, k in enumerate(keys)]


def test_roundtrip_and_longest_run(pool_dir):
    pool = KVPool(pool_dir, capacity_bytes=1 << 20)
    its = items(5)
    assert pool.put_many(its[:3]) == [True] * 3
    entries, lease = pool.lookup([it.key for it in its])
    assert [e.key for e in entries] == [it.key for it in its[:3]]  # stops at the first missing block
    assert bytes(pool.read(entries[1])) == its[1].data
    pool.release(lease)
    assert pool.lookup([its[4].key]) == ([], None)
    st = pool.stats()
    assert st.blocks == 3 and st.bytes_held == 3 * BLOCK


def test_damage_and_missing_files_are_detected(pool_dir):
    pool = KVPool(pool_dir)
    its = items(2)
    pool.put_many(its)
    e0, e1 = (pool.entry(it.key) for it in its)
    with open(pool.block_path(e0.key), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\x00\xff")
    with pytest.raises(BlockDamaged):
        pool.read(e0)
    os.unlink(pool.block_path(e1.key))
    with pytest.raises(BlockMissing):
        pool.read(e1)


def test_lru_eviction_respects_capacity(pool_dir):
    pool = KVPool(pool_dir, capacity_bytes=3 * BLOCK)
    a, b, c, d = items(4)
    pool.put_many([a, b, c])
    time.sleep(0.01)
    pool.release(pool.lookup([a.key])[1])  # touch a: b is now least recently used
    pool.put_many([d])
    held = {k for k in (a.key, b.key, c.key, d.key) if pool.entry(k)}
    assert held == {a.key, c.key, d.key}
    assert pool.stats().get("evictions") == 1
    assert not os.path.exists(pool.block_path(b.key))


def test_fanout_pins_and_leases_hold_blocks_until_released(pool_dir):
    pool = KVPool(pool_dir, capacity_bytes=2 * BLOCK, lease_timeout_s=30)
    a, b = items(2, tag=1)
    c, d = items(2, tag=2)
    pool.put_many([a, b], pins=2)  # a fan-out of 2 decoders
    assert pool.put_many([c]) == [False]  # nothing evictable: dropped, counted
    assert pool.stats().get("dropped_blocks") == 1
    pool.release(None, consumed=[a.key, b.key])
    assert pool.pins(a.key) == 1
    pool.release(None, consumed=[a.key, b.key])
    assert pool.pins(a.key) == 0
    # a reader's lease also protects: lease a, then two new blocks only evict b
    _, lease = pool.lookup([a.key])
    assert pool.put_many([c]) == [True]
    assert pool.entry(a.key) is not None and pool.entry(b.key) is None
    pool.release(lease)
    assert pool.put_many([d]) == [True]
    assert pool.entry(a.key) is None


def test_pins_expire_after_the_lease_timeout(pool_dir):
    pool = KVPool(pool_dir, capacity_bytes=BLOCK, lease_timeout_s=0.2)
    (a,), (b,) = items(1, tag=3), items(1, tag=4)
    pool.put_many([a], pins=3)
    assert pool.put_many([b]) == [False]
    time.sleep(0.3)
    assert pool.put_many([b]) == [True]


def test_bad_config_is_named(pool_dir):
    with pytest.raises(ValueError, match="capacity_bytes"):
        KVPool(pool_dir, capacity_bytes=0)
    with pytest.raises(ValueError, match="path"):
        KVPool("")


WRITER = """
import sys
from app.engine.kv_keys import block_keys
from app.engine.kv_pool import KVPool, PutItem
path, tag, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pool = KVPool(path)
for i in range(15):
    t = tag * 1000 + i
    its = [PutItem(k.key, bytes([(t + j) % 256]) * size, k.num_tokens, "L")
           for j, k in enumerate(block_keys("base", f"t{t}", list(range(12)), 4))]
    pool.put_many(its, scope=f"w{tag}")
    entries, lease = pool.lookup([it.key for it in its])
    for e in entries:
        pool.read(e)  # must never see a torn or damaged block
    pool.release(lease, consumed=[e.key for e in entries])
"""


def test_concurrent_processes_keep_the_pool_consistent(pool_dir):
    KVPool(pool_dir, capacity_bytes=20 * BLOCK)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, pool_dir, str(t), str(BLOCK)]) for t in range(3)]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    pool = KVPool(pool_dir)
    st = pool.stats()
    assert st.bytes_held <= 20 * BLOCK and st.blocks == st.bytes_held // BLOCK
    assert st.get("saved_blocks") == st.blocks + st.get("evictions")
    for name in os.listdir(os.path.join(pool_dir, "blocks")):
        for key in os.listdir(os.path.join(pool_dir, "blocks", name)):
            e = pool.entry(key)
            assert e is not None, "a block file without an index row"
            pool.read(e)
    assert set(pool.scopes()) >= {"w0", "w1", "w2"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ntok", [1, 13, 32])
def test_partial_block_copy_matches_the_attention_kernel_layout(dtype, ntok):
    """Base KV for tokens < ntok copied in, then the decoder's kernel writes the rest: the block
    must equal one where the kernel wrote base tokens < ntok and decoder tokens >= ntok."""
    from vllm._custom_ops import cpu_attn_reshape_and_cache
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nb, h, bs, d, layers = 3, 2, 32, 64, 2
    isa = _get_attn_isa(dtype, bs, d)
    g = torch.Generator().manual_seed(0)
    base_k, base_v, dec_k, dec_v = (torch.randn(bs, h, d, generator=g).to(dtype) for _ in range(4))

    def write(cache, k, v, block, positions):
        kc, vc = cache.view(nb, h, bs * 2, d).chunk(2, dim=2)
        cpu_attn_reshape_and_cache(k[positions].contiguous(), v[positions].contiguous(), kc, vc,
                                   torch.tensor(positions) + block * bs, isa)

    prod = [torch.zeros(nb, h, bs, 2 * d, dtype=dtype) for _ in range(layers)]
    for c in prod:
        write(c, base_k, base_v, 1, list(range(bs)))
    ref = [torch.zeros(nb, h, bs, 2 * d, dtype=dtype) for _ in range(layers)]
    for c in ref:
        write(c, base_k, base_v, 2, list(range(ntok)))
        if ntok < bs:
            write(c, dec_k, dec_v, 2, list(range(ntok, bs)))
    cons = [torch.full((nb, h, bs, 2 * d), 7.0, dtype=dtype) for _ in range(layers)]
    src = BlockLayout.from_caches(prod, bs, h, d)
    dst = BlockLayout.from_caches(cons, bs, h, d)
    assert src.layout == dst.layout and src.layout.startswith("cpu_attn-")
    block = src.gather(1)
    dst.scatter(dst.view_bytes(bytearray(block.view(torch.uint8).numpy().tobytes())), 2, ntok)
    for c in cons:
        if ntok < bs:
            write(c, dec_k, dec_v, 2, list(range(ntok, bs)))
    for c, r in zip(cons, ref):
        assert torch.equal(c[2], r[2])
        assert torch.equal(c[0], torch.full_like(c[0], 7.0))  # other blocks untouched


def test_a_chain_never_evicts_itself_and_shrinks_from_its_tail(pool_dir):
    pool = KVPool(pool_dir, capacity_bytes=3 * BLOCK)
    old = [PutItem(it.key, it.data, it.ntokens, it.layout, depth=i) for i, it in enumerate(items(3, tag=5))]
    pool.put_many(old)
    new = [PutItem(it.key, it.data, it.ntokens, it.layout, depth=i) for i, it in enumerate(items(2, tag=6))]
    assert pool.put_many(new) == [True, True]
    assert [pool.entry(it.key) is not None for it in old] == [True, False, False]  # tail went first
    longer = items(4, tag=7)
    assert pool.put_many(longer) == [True, True, True, False]  # the 4th block does not fit
    assert pool.stats().get("dropped_blocks") == 1
