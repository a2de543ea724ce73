"""Real vLLM engines: decoders of other weights consume a base engine's KV through the connector.

One producer engine (base A) and three consumer engines (decoders B, C, D: same shapes, other
weights) share one pool; every decoded token is checked against the transformers reference
(prefillshare.app.reference). Prompts are longer than one prefill chunk (max_num_batched_tokens=64) and not
multiples of the block size (32), so chunked saves and partial-block hand-over are exercised.
"""
from __future__ import annotations

import asyncio
import random
import shutil
import threading
import uuid

import pytest
import torch

from tests.engine_child import CPU_TEST_ENGINE_ENV

pytestmark = pytest.mark.engine

N_NEW = 8
BS = 32


def make_model(path: str, seed: int) -> None:
    """A random Llama of the shipped shape (docs/DESIGN.md), weights scaled so greedy tokens vary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                      num_key_value_heads=1, head_dim=64, intermediate_size=512,
                      max_position_embeddings=1024, tie_word_embeddings=True, initializer_range=0.1,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(path)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for seed, name in enumerate("ABCD"):
        dirs[name] = str(root / name)
        make_model(dirs[name], 100 + seed)
    return dirs


@pytest.fixture(scope="session")
def hf(model_dirs):
    from transformers import LlamaForCausalLM

    return {n: LlamaForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for n, p in model_dirs.items()}


class Loop:
    """One asyncio loop in a thread: engines live on it, tests submit coroutines to it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def pool_dir():
    return f"/dev/shm/ps-test-connector-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def stack(model_dirs, pool_dir):
    from prefillshare.app.engine.async_engine import Engine, EngineConfig
    from prefillshare.app.engine.pool.handover import connector_config
    from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec

    spec = PoolSpec(path=pool_dir, capacity_bytes=256 << 20, lease_timeout_s=120)
    # The producer writes a crc32 per slot and decoder D checks it (the opt-in check mode);
    # B and C load on the default path (generations only).
    checked = PoolSpec(path=pool_dir, capacity_bytes=256 << 20, lease_timeout_s=120, check="crc32")
    common = dict(dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=512, block_size=BS,
                  max_num_batched_tokens=64, skip_tokenizer_init=True, extra_env=CPU_TEST_ENGINE_ENV, request_timeout_s=240)
    cfgs = {"A": EngineConfig(model=model_dirs["A"], **common,
                              kv_transfer_config=connector_config("producer", "base-A", checked))}
    for name in "BCD":
        kv = connector_config("consumer", "base-A", checked if name == "D" else spec, scope=f"dec-{name}")
        cfgs[name] = EngineConfig(model=model_dirs[name], **common, kv_transfer_config=kv)
    loop = Loop()
    engines = {}

    async def start_all():
        started = await asyncio.gather(*[Engine.start(c) for c in cfgs.values()], return_exceptions=True)
        engines.update({n: e for n, e in zip(cfgs, started) if not isinstance(e, BaseException)})
        errors = [e for e in started if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    try:
        # Same env for every engine, so they can start concurrently (startup dominates this file);
        # set only while they start: the engine cores have it, later tests' processes do not.
        with pytest.MonkeyPatch.context() as env:
            env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
            for k, v in CPU_TEST_ENGINE_ENV.items():
                env.setenv(k, v)
            loop.run(start_all(), timeout=1800)  # a hang guard: engine start-up takes minutes on a busy box
        yield loop, engines, KVPool.attach(pool_dir)
    finally:
        for e in engines.values():
            e.shutdown()
        loop.close()
        shutil.rmtree(pool_dir, ignore_errors=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def shared_ref(hf, base, dec, p):
    from prefillshare.app.reference import shared_greedy

    return shared_greedy(hf[base], hf[dec], p, N_NEW)


def private_ref(hf, dec, p):
    from prefillshare.app.reference import private_greedy

    return private_greedy(hf[dec], p, N_NEW)


def decode(loop, engine, p, salt="tenant-1"):
    from prefillshare.app.engine.async_engine import Sampling

    return loop.run(engine.complete(p, Sampling(max_tokens=N_NEW, ignore_eos=True), cache_salt=salt))


def test_decoder_on_base_kv_matches_reference_concurrently(stack, hf):
    from prefillshare.app.engine.async_engine import Sampling

    loop, eng, pool = stack
    prompts = [prompt(i, n) for i, n in enumerate((150, 77, 201, 97))]
    async def prefill_then_decode():
        res = await asyncio.gather(*[eng["A"].prefill(p, cache_salt="tenant-1", kv_transfer_params={"fanout": 1})
                                     for p in prompts])
        outs = await asyncio.gather(*[eng["B"].complete(p, Sampling(max_tokens=N_NEW, ignore_eos=True),
                                                        cache_salt="tenant-1") for p in prompts])
        return res, outs

    res, outs = loop.run(prefill_then_decode())
    assert [r.num_prompt_tokens for r in res] == [len(p) for p in prompts]
    differs = 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == shared_ref(hf, "A", "B", p)
        assert o.num_cached_tokens == len(p) - 1
        assert o.kv_transfer_params["prefillshare"]["loaded_tokens"] == len(p) - 1
        differs += o.token_ids != private_ref(hf, "B", p)
    assert differs, "the base KV changed no decoded token: the test could not tell shared from private"
    st = pool.stats(scope="dec-B")
    assert st.get("loads") >= 4 and st.get("bytes_moved") > 0 and st.load_seconds_per_token > 0


def test_one_prefill_fans_out_to_three_decoders(stack, hf):
    from prefillshare.app.engine.pool.kv_keys import shared_block_keys

    loop, eng, pool = stack
    p = prompt(10, 173)
    r = loop.run(eng["A"].prefill(p, cache_salt="tenant-1", kv_transfer_params={"fanout": 3}))
    keys = [k.key for k in shared_block_keys("base-A", "tenant-1", p, BS)]
    assert [pool.pins(k) for k in keys] == [3] * len(keys)
    assert r.kv_transfer_params["prefillshare"]["blocks"] == len(keys) == -(-(len(p) - 1) // BS)

    async def all_three():
        from prefillshare.app.engine.async_engine import Sampling

        s = Sampling(max_tokens=N_NEW, ignore_eos=True)
        return await asyncio.gather(*[eng[n].complete(p, s, cache_salt="tenant-1") for n in "BCD"])

    outs = loop.run(all_three())
    for name, o in zip("BCD", outs):
        assert o.token_ids == shared_ref(hf, "A", name, p), name
        assert o.num_cached_tokens == len(p) - 1
    assert [pool.pins(k) for k in keys] == [0] * len(keys)  # every decoder of the fan-out loaded them


def test_missing_block_falls_back_to_private_prefill(stack, hf):
    from prefillshare.app.engine.pool.kv_keys import shared_block_keys

    loop, eng, pool = stack
    p = prompt(20, 130)
    loop.run(eng["A"].prefill(p, cache_salt="tenant-1"))
    keys = shared_block_keys("base-A", "tenant-1", p, BS)
    before = pool.stats(scope="dec-C").get("fallback:missing")
    pool.discard([keys[2].key])
    o = decode(loop, eng["C"], p)
    assert o.token_ids == private_ref(hf, "C", p)
    assert o.num_cached_tokens == 0
    assert o.kv_transfer_params["prefillshare"]["fallback"] == "missing"
    assert pool.stats(scope="dec-C").get("fallback:missing") == before + 1


def test_damaged_block_falls_back_to_private_prefill(stack, hf):
    from prefillshare.app.engine.pool.kv_keys import shared_block_keys

    loop, eng, pool = stack
    p = prompt(30, 140)
    loop.run(eng["A"].prefill(p, cache_salt="tenant-1"))
    key = shared_block_keys("base-A", "tenant-1", p, BS)[1].key
    pool.view(pool.entry(key))[1000:1064] = b"\x7f" * 64  # flip bytes in place (D checks crc32)
    before = pool.stats(scope="dec-D").get("fallback:damaged")
    o = decode(loop, eng["D"], p)
    assert o.token_ids == private_ref(hf, "D", p)
    assert pool.stats(scope="dec-D").get("fallback:damaged") == before + 1
    assert pool.entry(key) is None  # the damaged block was dropped; the next save replaces it


def test_torn_slot_of_a_producer_that_died_mid_save_falls_back_to_private_prefill(stack, hf):
    """A slot whose writer never published (generation left odd): no decoder loads it."""
    from prefillshare.app.engine.pool.kv_keys import shared_block_keys

    loop, eng, pool = stack
    p = prompt(35, 120)
    loop.run(eng["A"].prefill(p, cache_salt="tenant-1"))
    e = pool.entry(shared_block_keys("base-A", "tenant-1", p, BS)[2].key)
    pool.slab(e.slab).set_gen(e.slot, e.gen - 1)  # as if the producer died while writing it
    before = pool.stats(scope="dec-C").get("fallback:missing")
    o = decode(loop, eng["C"], p)
    assert o.num_cached_tokens == 0 and o.token_ids == private_ref(hf, "C", p)
    assert o.kv_transfer_params["prefillshare"]["fallback"] == "missing"  # never offered
    assert pool.stats(scope="dec-C").get("fallback:missing") == before + 1
    # a slot "being written" is never evicted before lease_timeout_s: drop it so that the
    # capacity tests below start from evictable blocks only
    pool.discard([e.key])


def test_eviction_under_small_capacity_and_fanout_pins(stack, hf):
    from prefillshare.app.engine.pool.kv_keys import shared_block_keys

    loop, eng, pool = stack
    x, y, z = prompt(40, 100), prompt(41, 100), prompt(42, 100)  # 4 blocks each (99 shared tokens)
    old_cap = pool.capacity_bytes
    try:
        loop.run(eng["A"].prefill(x, cache_salt="tenant-1", kv_transfer_params={"fanout": 1}))
        block_bytes = pool.entry(shared_block_keys("base-A", "tenant-1", x, BS)[0].key).nbytes
        pool.set_capacity(5 * block_bytes)  # room for x and one more block
        ev0, drop0 = pool.stats().get("evictions"), pool.stats().get("dropped_blocks")
        loop.run(eng["A"].prefill(y, cache_salt="tenant-1"))  # evicts older blocks, never pinned x
        st = pool.stats()
        db = pool._db()
        state = {"leases": db.execute("SELECT COUNT(*) FROM leases").fetchone()[0],
                 "pinned": db.execute("SELECT COUNT(*) FROM blocks WHERE pins > 0").fetchone()[0], "stats": st}
        assert st.get("evictions") > ev0, state
        assert st.get("dropped_blocks") == drop0 + 3 and st.bytes_held <= 5 * block_bytes, state
        o = decode(loop, eng["B"], x)  # x stayed: pinned for its one decoder
        assert o.num_cached_tokens == len(x) - 1 and o.token_ids == shared_ref(hf, "A", "B", x)
        o = decode(loop, eng["C"], y)  # y only partly stored: private prefill
        assert o.num_cached_tokens == 0 and o.token_ids == private_ref(hf, "C", y)
        loop.run(eng["A"].prefill(z, cache_salt="tenant-1"))  # x is unpinned now: evicted for z
        o = decode(loop, eng["B"], x)
        assert o.num_cached_tokens == 0 and o.token_ids == private_ref(hf, "B", x)
        o = decode(loop, eng["C"], z)
        assert o.num_cached_tokens == len(z) - 1 and o.token_ids == shared_ref(hf, "A", "C", z)
    finally:
        pool.set_capacity(old_cap)


def test_tenant_salt_isolates_kv(stack, hf):
    loop, eng, pool = stack
    p = prompt(50, 90)
    loop.run(eng["A"].prefill(p, cache_salt="tenant-1"))
    o = decode(loop, eng["B"], p, salt="tenant-2")
    assert o.num_cached_tokens == 0 and o.token_ids == private_ref(hf, "B", p)
    o = decode(loop, eng["B"], p, salt="tenant-1")
    assert o.num_cached_tokens == len(p) - 1 and o.token_ids == shared_ref(hf, "A", "B", p)


def test_engine_errors_surface(stack):
    from prefillshare.app.engine.async_engine import EngineRequestError, Sampling

    loop, eng, _ = stack
    with pytest.raises(EngineRequestError, match="max_model_len"):
        loop.run(eng["B"].complete(list(range(3, 600)), Sampling(max_tokens=2)))
    with pytest.raises(EngineRequestError, match="empty"):
        loop.run(eng["B"].complete([], Sampling(max_tokens=2)))
    loop.run(eng["B"].check_health())


def _fan_out(loop, eng, p):
    """Decoders B, C, D on one prompt at once."""
    from prefillshare.app.engine.async_engine import Sampling

    async def three():
        s = Sampling(max_tokens=N_NEW, ignore_eos=True)
        return await asyncio.gather(*[eng[n].complete(p, s, cache_salt="tenant-1") for n in "BCD"])

    return dict(zip("BCD", loop.run(three())))


def _misses(pool) -> dict[str, float]:
    return {n: pool.stats(scope=f"dec-{n}").get("fallback:missing") for n in "BCD"}


def test_fan_out_evicted_between_prefill_and_decode_falls_back_for_every_decoder(stack, hf):
    from prefillshare.app.engine.pool.kv_keys import shared_block_keys

    loop, eng, pool = stack
    p = prompt(80, 150)
    loop.run(eng["A"].prefill(p, cache_salt="tenant-1", kv_transfer_params={"fanout": 3}))
    keys = [k.key for k in shared_block_keys("base-A", "tenant-1", p, BS)]
    assert [pool.pins(k) for k in keys] == [3] * len(keys)
    before = _misses(pool)
    pool.discard(keys[-1:])  # the deepest block goes first under LRU eviction
    outs = _fan_out(loop, eng, p)
    for n, o in outs.items():
        assert o.num_cached_tokens == 0 and o.token_ids == private_ref(hf, n, p), n
        assert o.kv_transfer_params["prefillshare"]["fallback"] == "missing"
    assert _misses(pool) == {n: v + 1 for n, v in before.items()}


def test_pool_full_of_pinned_blocks_drops_a_new_fan_out_whose_decoders_prefill_privately(stack, hf):
    """Capacity holds one pinned fan-out: the next fan-out's save cannot evict it, its blocks
    are dropped, and all three of its decoders prefill privately; the pinned one still loads."""
    from prefillshare.app.engine.pool.kv_keys import shared_block_keys

    loop, eng, pool = stack
    x, y = prompt(90, 120), prompt(91, 120)  # 4 blocks each
    old_cap = pool.capacity_bytes
    try:
        loop.run(eng["A"].prefill(x, cache_salt="tenant-1", kv_transfer_params={"fanout": 3}))
        x_keys = [k.key for k in shared_block_keys("base-A", "tenant-1", x, BS)]
        pool.set_capacity(sum(pool.entry(k).nbytes for k in x_keys) + 1)  # full: x's pinned blocks
        before, dropped = _misses(pool), pool.stats().get("dropped_blocks")
        loop.run(eng["A"].prefill(y, cache_salt="tenant-1", kv_transfer_params={"fanout": 3}))
        assert pool.stats().get("dropped_blocks") == dropped + 4
        assert all(pool.entry(k.key) is None for k in shared_block_keys("base-A", "tenant-1", y, BS))
        for n, o in _fan_out(loop, eng, y).items():
            assert o.num_cached_tokens == 0 and o.token_ids == private_ref(hf, n, y), n
        assert _misses(pool) == {n: v + 1 for n, v in before.items()}
        for n, o in _fan_out(loop, eng, x).items():
            assert o.num_cached_tokens == len(x) - 1 and o.token_ids == shared_ref(hf, "A", n, x), n
    finally:
        pool.set_capacity(old_cap)
