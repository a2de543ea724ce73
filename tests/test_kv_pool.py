"""The node-local KV pool (slab slots, LRU, leases, fan-out pins, seqlock, processes) and block layouts."""
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import asdict

import pytest
import torch

from prefillshare.app.engine.cpu_layout import BlockLayout, joint_runs, slot_runs
from prefillshare.app.engine.pool import kv_pool
from prefillshare.app.engine.pool.kv_keys import block_keys
from prefillshare.app.engine.pool.kv_pool import BlockDamaged, KVPool, PoolSpec, SlotReused, SlotTorn
from tests.kv_blocks import Block, put, read

BLOCK = 4096


@pytest.fixture
def pool_dir():
    d = f"/dev/shm/ps-test-pool-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def items(n, tag=0, size=BLOCK):
    keys = block_keys("base", f"t{tag}", list(range(n * 4)), 4)
    return [Block(k.key, bytes([(tag * 31 + i) % 256]) * size, k.num_tokens, "L") for i, k in enumerate(keys)]


def test_roundtrip_and_longest_run(pool_dir):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=1 << 20))
    its = items(5)
    assert put(pool, its[:3]) == [True] * 3
    entries, lease = pool.fetch([it.key for it in its])
    assert [e.key for e in entries] == [it.key for it in its[:3]]  # stops at the first missing block
    assert len({e.slot for e in entries}) == 3 and all(e.gen % 2 == 0 for e in entries)
    assert bytes(read(pool, entries[1])) == its[1].data
    pool.release(lease)
    assert pool.fetch([its[4].key]) == ([], None)
    st = pool.stats()
    assert st.blocks == 3 and st.bytes_held == 3 * BLOCK and st.slot_bytes == (BLOCK,)
    other = KVPool(PoolSpec(pool_dir))  # another opener sees the same slab and capacity
    assert bytes(read(other, other.entry(its[2].key))) == its[2].data and other.capacity_bytes == 1 << 20


def test_find_is_a_pure_read(pool_dir):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=2 * BLOCK))
    a, b = items(2, tag=9)
    put(pool, [a, b])
    for _ in range(3):
        assert [e.key for e in pool.find([a.key, b.key])] == [a.key, b.key]
    assert put(pool, items(2, tag=10)) == [True, True]  # no lease was left behind
    assert pool.stats().get("evictions") == 2


def test_torn_reused_and_damaged_slots_are_detected(pool_dir):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=2 * BLOCK, check="crc32"))
    a, b = items(2, tag=1)
    put(pool, [a, b])
    ea, eb = pool.entry(a.key), pool.entry(b.key)
    pool.view(ea)[100:103] = b"\xff\x00\xff"  # damage in place: only the crc32 check mode sees it
    with pytest.raises(BlockDamaged, match="checksum"):
        read(pool, ea)
    assert read(KVPool(PoolSpec(pool_dir)), ea)  # with checks off the damage goes unseen: why check mode exists
    pool.slab(BLOCK).set_gen(eb.slot, eb.gen - 1)  # a writer that never finished
    with pytest.raises(SlotTorn):
        read(pool, eb)
    assert pool.find([b.key]) == []  # not offered to readers either
    pool.discard([a.key, b.key])
    c, d = items(2, tag=2)
    put(pool, [c, d])  # the same slots, new generations
    with pytest.raises(SlotReused):
        read(pool, ea)
    assert pool.entry(c.key).slot in (ea.slot, eb.slot) and pool.entry(c.key).gen > ea.gen


class FakeClock:
    """The pool's clock (``time.time`` in app/engine/pool/kv_pool.py), standing still until a test moves it:
    lease and pin windows then hold or expire exactly when the test says, however loaded the machine."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock(time.time())
    monkeypatch.setattr(kv_pool, "time", fake)
    return fake


def test_lru_eviction_respects_capacity(pool_dir, clock):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=3 * BLOCK))
    a, b, c, d = items(4)
    put(pool, [a, b, c])
    clock.advance(1)
    pool.release(pool.fetch([a.key])[1])  # touch a: b is now least recently used
    put(pool, [d])
    held = {k for k in (a.key, b.key, c.key, d.key) if pool.entry(k)}
    assert held == {a.key, c.key, d.key}
    assert pool.stats().get("evictions") == 1
    assert bytes(read(pool, pool.entry(d.key))) == d.data


def test_fanout_pins_and_leases_hold_blocks_until_released(pool_dir):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=2 * BLOCK, lease_timeout_s=30))
    a, b = items(2, tag=1)
    c, d = items(2, tag=2)
    put(pool, [a, b], pins=2)  # a fan-out of 2 decoders
    assert put(pool, [c]) == [False]  # nothing evictable: dropped, counted
    assert pool.stats().get("dropped_blocks") == 1
    pool.release(None, consumed=[a.key, b.key])
    assert pool.pins(a.key) == 1
    pool.release(None, consumed=[a.key, b.key])
    assert pool.pins(a.key) == 0
    # a reader's lease also protects: lease a, then two new blocks only evict b
    _, lease = pool.fetch([a.key])
    assert put(pool, [c]) == [True]
    assert pool.entry(a.key) is not None and pool.entry(b.key) is None
    pool.release(lease)
    assert put(pool, [d]) == [True]
    assert pool.entry(a.key) is None


def test_pins_expire_after_the_lease_timeout(pool_dir, clock):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=BLOCK, lease_timeout_s=30))
    (a,), (b,) = items(1, tag=3), items(1, tag=4)
    put(pool, [a], pins=3)
    assert put(pool, [b]) == [False]
    clock.advance(29)
    assert put(pool, [b]) == [False]  # pinned to the end of its window
    clock.advance(2)
    assert put(pool, [b]) == [True]


def test_bad_config_is_named(pool_dir):
    with pytest.raises(ValueError, match="capacity_bytes"):
        KVPool(PoolSpec(pool_dir, capacity_bytes=0))
    with pytest.raises(ValueError, match="path"):
        KVPool(PoolSpec(""))
    with pytest.raises(ValueError, match="PoolSpec.check"):
        PoolSpec(path=pool_dir, check="md5")
    with pytest.raises(TypeError, match="capacity"):  # an unknown field, as the connector rebuilds a spec
        PoolSpec(**{"path": pool_dir, "capacity": 5})
    spec = PoolSpec(pool_dir, check="crc32", persist=True)
    assert PoolSpec(**asdict(spec)) == spec


def test_counters_are_written_with_the_next_transaction(pool_dir):
    pool = KVPool(PoolSpec(pool_dir))
    pool.add("dec", {"hits": 2, "fallback:missing": 1})
    assert KVPool(PoolSpec(pool_dir)).stats("dec").get("hits") == 0  # in memory only
    assert pool.stats("dec").get("hits") == 2  # the process that counted sees them
    put(pool, items(1, tag=6))  # any transaction carries them
    st = KVPool(PoolSpec(pool_dir)).stats("dec")
    assert st.get("hits") == 2 and st.fallbacks == {"missing": 1}
    pool.add("dec", {"hits": 1})
    pool.flush()
    assert KVPool(PoolSpec(pool_dir)).stats("dec").get("hits") == 3


WRITER = """
import sys
from prefillshare.app.engine.pool.kv_keys import block_keys
from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec
from tests.kv_blocks import Block, put, read
path, tag, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pool = KVPool(PoolSpec(path))
for i in range(15):
    t = tag * 1000 + i
    its = [Block(k.key, bytes([(t + j) % 256]) * size, k.num_tokens, "L", j)
           for j, k in enumerate(block_keys("base", f"t{t}", list(range(12)), 4))]
    put(pool, its, scope=f"w{tag}")
    entries, lease = pool.fetch([it.key for it in its])
    for e, it in zip(entries, its):
        assert read(pool, e) == it.data  # leased: never reused under us
    pool.release(lease, consumed=[e.key for e in entries])
"""


def test_concurrent_processes_keep_the_pool_consistent(pool_dir):
    creator = KVPool(PoolSpec(pool_dir, capacity_bytes=20 * BLOCK))  # noqa: F841 - holds the pool open
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, pool_dir, str(t), str(BLOCK)]) for t in range(3)]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    pool = KVPool(PoolSpec(pool_dir))
    st = pool.stats()
    assert st.bytes_held <= 20 * BLOCK and st.blocks == st.bytes_held // BLOCK
    assert st.get("saved_blocks") == st.blocks + st.get("evictions")
    rows = pool._db().execute("SELECT key, slot FROM blocks").fetchall()
    assert len({s for _, s in rows}) == len(rows)  # one block per slot
    used = pool._db().execute("SELECT COUNT(*) FROM slots WHERE used = 1").fetchone()[0]
    assert used == len(rows)
    for key, _ in rows:
        read(pool, pool.entry(key))
    assert set(pool.scopes()) >= {"w0", "w1", "w2"}


# -- the seqlock under fire: slow writers reuse slots while readers copy ---------------------
SLOW_WRITER = """
import sys, time
from prefillshare.app.engine.pool.kv_keys import block_keys
from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec
path, tag, size, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
pool = KVPool(PoolSpec(path))
pool.slab(size)
print("ready", flush=True); sys.stdin.readline()
stop_at, i = time.time() + secs, 0
while time.time() < stop_at:  # blocks of one byte value, each written in two halves 2 ms apart
    res = pool.reserve([block_keys("w", f"{tag}-{i}", [1, 2, 3, 4], 4)[0].key], size, [4], "L")
    for e in res.new:
        v, fill = pool.slab(size).view(e.slot), (tag * 64 + i) % 251 + 1
        v[: size // 2] = bytes([fill]) * (size // 2)
        time.sleep(0.002)
        v[size // 2 :] = bytes([fill]) * (size // 2)
    pool.publish(res)
    i += 1
"""

READER = """
import sys, time
from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec, SlotReused, SlotTorn
path, size, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
pool = KVPool(PoolSpec(path))
pool.slab(size)
print("ready", flush=True); sys.stdin.readline()
stop_at, accepted, detected, wrong = time.time() + secs, 0, 0, 0
while time.time() < stop_at:  # an accepted copy must be one byte value throughout
    for (key,) in pool._db().execute("SELECT key FROM blocks").fetchall():
        e = pool.entry(key)
        if e is None:
            continue
        try:
            pool.check_entries([e])
            data = bytes(pool.slab(size).view(e.slot))
            pool.check_entries([e])
        except (SlotReused, SlotTorn):
            detected += 1
            continue
        accepted += 1
        wrong += data.count(data[0]) != len(data)
print(accepted, detected, wrong, flush=True)
"""


def test_a_reader_never_accepts_a_reused_or_half_written_slot(pool_dir):
    creator = KVPool(PoolSpec(pool_dir, capacity_bytes=2 * BLOCK))
    put(creator, items(1))  # 2 slots: writers evict each other
    secs = "2.0"
    procs = [subprocess.Popen([sys.executable, "-c", SLOW_WRITER, pool_dir, str(t), str(BLOCK), secs],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for t in range(2)]
    procs += [subprocess.Popen([sys.executable, "-c", READER, pool_dir, str(BLOCK), secs],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:  # all started: go at once
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    accepted, detected, wrong = (sum(int(o.split()[i]) for o in outs[2:]) for i in range(3))
    print(f"\nseqlock: {accepted} copies accepted, {detected} reused/torn slots detected, {wrong} wrong")
    assert wrong == 0
    assert accepted > 0 and detected > 0


# -- faults: a producer dies mid-save, a decoder dies holding a lease ---------------------------
# these processes keep the real clock: their windows are 30 s of it, and the test's fake clock
# (copied from the real one once they are gone) moves past them
DIE_MID_SAVE = """
import os, sys
from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec
pool = KVPool(PoolSpec(sys.argv[1], lease_timeout_s=30))
res = pool.reserve([sys.argv[2]], int(sys.argv[3]), [4], "L", pins=2)
pool.slab(int(sys.argv[3])).view(res.new[0].slot)[:10] = b"x" * 10
os._exit(0)  # never publishes
"""

DIE_HOLDING_LEASE = """
import os, sys
from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec
pool = KVPool(PoolSpec(sys.argv[1]))
assert pool.fetch([sys.argv[2]], lease_s=30)[1]
os._exit(0)
"""


def _run(script, *args):
    subprocess.run([sys.executable, "-c", script, *map(str, args)], check=True, timeout=120)


def test_a_producer_dying_mid_save_leaves_a_torn_slot_that_expires(pool_dir, clock):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=BLOCK, lease_timeout_s=30))
    (a,), (b,) = items(1, tag=7), items(1, tag=8)
    _run(DIE_MID_SAVE, pool_dir, a.key, BLOCK)
    clock.now = time.time()
    e = pool.entry(a.key)
    assert e is not None and pool.find([a.key]) == []  # indexed, never offered
    with pytest.raises(SlotTorn):
        pool.check_entries([e])
    assert put(pool, [b]) == [False]  # its pins hold the only slot ...
    clock.advance(31)
    assert put(pool, [b]) == [True]  # ... until they expire
    assert bytes(read(pool, pool.entry(b.key))) == b.data
    assert pool.stats().get("expired_pins") == 1


def test_a_decoder_dying_with_a_lease_blocks_eviction_only_until_it_expires(pool_dir, clock):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=BLOCK))
    (a,), (b,) = items(1, tag=11), items(1, tag=12)
    put(pool, [a])
    _run(DIE_HOLDING_LEASE, pool_dir, a.key)
    clock.now = time.time()
    assert put(pool, [b]) == [False]
    clock.advance(31)
    assert put(pool, [b]) == [True] and pool.entry(a.key) is None
    assert pool.stats().get("expired_leases") == 1


# -- block layouts: batched copies equal the per-block reference bit for bit -----------------
LAYOUTS = {
    # name: (cache shape for nb blocks, block_size, heads, head, device_layout)
    "cpu_attn": (lambda nb: (nb, 2, 16, 2 * 32), 16, 2, 32, False),
    "flash": (lambda nb: (2, nb, 16, 2, 32), 16, 2, 32, True),
    "blocks_first": (lambda nb: (nb, 2, 16, 2, 32), 16, 2, 32, True),
}


def _caches(shape, layers, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(layers)]


ORDERS = {  # (source block ids, slots, destination block ids)
    "scattered": ([7, 2, 9, 3, 11], [4, 5, 6, 0, 1], [1, 0, 8, 4, 6]),  # index ops per run of slots
    "consecutive": ([2, 3, 4, 5, 6, 7, 8, 11], [0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 9]),  # plain copies
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("last_tokens", [16, 5])
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_batched_slot_copies_equal_the_per_block_reference(name, last_tokens, order):
    shape, bs, h, d, device_layout = LAYOUTS[name]
    nb, layers, dtype = 12, 3, torch.bfloat16
    src = BlockLayout.from_caches(_caches(shape(nb), layers, dtype, 1), bs, h, d, nb, device_layout)
    ids, slots, dst_ids = ORDERS[order]
    if order == "scattered":
        assert slot_runs(slots) == [(0, 4, 3), (3, 0, 2)] and len(joint_runs(slots, ids)) == 5
    else:
        assert joint_runs(slots, ids) == [(0, 0, 2, 7), (7, 7, 11, 1)]
    slab = torch.zeros(8, src.block_nbytes + 64, dtype=torch.uint8)  # stride > slot: padded rows
    src.save_slots(ids, slab, slots)
    for b, s in zip(ids, slots):  # save: each slot holds exactly what gather() gives
        assert torch.equal(src.slots_view(slab, s, 1)[0], src.gather(b))
    assert not slab[:, src.block_nbytes:].any()  # nothing written past a slot
    batched = BlockLayout.from_caches(_caches(shape(nb), layers, dtype, 2), bs, h, d, nb, device_layout)
    ref = BlockLayout.from_caches([c.clone() for c in batched.caches], bs, h, d, nb, device_layout)
    batched.load_slots(slab, slots, dst_ids, last_tokens)
    for j, (b, s) in enumerate(zip(dst_ids, slots)):
        ref.scatter(ref.slots_view(slab, s, 1)[0], b, last_tokens if j == len(slots) - 1 else bs)
    for x, y in zip(batched.caches, ref.caches):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    if last_tokens < bs:  # the partial block: its first tokens are the producer's, the rest untouched
        whole = BlockLayout.from_caches([c.clone() for c in batched.caches], bs, h, d, nb, device_layout)
        whole.load_slots(slab, slots, dst_ids)
        assert not all(torch.equal(x, y) for x, y in zip(whole.caches, batched.caches))


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
    slab = torch.zeros(2, src.block_nbytes, dtype=torch.uint8)
    src.save_slots([1], slab, [1])  # the batched path, through a slab slot
    dst.load_slots(slab, [1], [2], ntok)
    for c in cons:
        if ntok < bs:
            write(c, dec_k, dec_v, 2, list(range(ntok, bs)))
    for c, r in zip(cons, ref):
        assert torch.equal(c[2], r[2])
        assert torch.equal(c[0], torch.full_like(c[0], 7.0))  # other blocks untouched


def test_a_chain_never_evicts_itself_and_shrinks_from_its_tail(pool_dir):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=3 * BLOCK))
    old = [Block(it.key, it.data, it.ntokens, it.layout, depth=i) for i, it in enumerate(items(3, tag=5))]
    put(pool, old)
    new = items(2, tag=6)
    assert put(pool, new) == [True, True]
    assert [pool.entry(it.key) is not None for it in old] == [True, False, False]  # tail went first
    longer = items(4, tag=7)
    assert put(pool, longer) == [True, True, True, False]  # the 4th block does not fit
    assert pool.stats().get("dropped_blocks") == 1


def test_capacity_grows_the_slab_for_every_process(pool_dir):
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=2 * BLOCK))
    put(pool, items(2, tag=13))
    other = KVPool(PoolSpec(pool_dir))
    other.slab(BLOCK)  # mapped at 2 slots
    pool.set_capacity(6 * BLOCK)
    its = items(4, tag=14)
    assert put(pool, its) == [True] * 4
    e = other.entry(its[-1].key)
    assert e.slot >= 2 and bytes(read(other, e)) == its[-1].data  # remapped on demand


def test_only_the_creator_sets_the_capacity_and_readers_never_create(pool_dir):
    from prefillshare.app.engine.pool.kv_pool import PoolMissing

    with pytest.raises(PoolMissing):
        KVPool.attach(pool_dir)  # a reader (metrics) before any engine: no pool is made
    pool = KVPool(PoolSpec(pool_dir, capacity_bytes=3 * BLOCK))
    other = KVPool(PoolSpec(pool_dir, capacity_bytes=50 * BLOCK))  # a second opener keeps the pool's
    assert other.capacity_bytes == pool.capacity_bytes == 3 * BLOCK
    assert KVPool.attach(pool_dir).capacity_bytes == 3 * BLOCK
    pool.set_capacity(4 * BLOCK)  # an explicit change is seen by every opener
    assert other.capacity_bytes == 4 * BLOCK
