"""The connector's scheduler half without an engine: fake vLLM requests, block lists and
scheduler outputs over a real node pool (what tokens a request takes, what a producer saves,
why a request prefills privately, what request_finished counts)."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace as NS

import pytest

from prefillshare.app.engine.pool.connector.metadata import ConnectorSettings
from prefillshare.app.engine.pool.connector.scheduler import ShareScheduler
from prefillshare.app.engine.pool.kv_keys import key_salt, shared_block_keys
from tests.kv_blocks import Block, put, temp_pool

BS = 32
LAYOUT = "L"


@dataclass
class FakeRequest:
    """The fields of vllm.v1.request.Request the scheduler half reads."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = "tenant-1"
    lora_request: object | None = None
    kv_transfer_params: dict | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class FakeBlocks:
    """vllm's KVCacheBlocks: block ids per cache group."""

    ids: list[int]

    def get_block_ids(self):
        return (self.ids,)


@dataclass
class FakeOutput:
    """vllm's SchedulerOutput: new requests, cached (running) ones, tokens scheduled per request."""

    new: list[tuple[str, list[int], int]] = field(default_factory=list)  # (id, block ids, computed)
    cached: list[tuple[str, list[int] | None, int]] = field(default_factory=list)  # (id, new ids, computed)
    scheduled: dict[str, int] = field(default_factory=dict)
    resumed: set[str] = field(default_factory=set)

    @property
    def scheduled_new_reqs(self):
        return [NS(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in self.new]

    @property
    def scheduled_cached_reqs(self):
        return NS(req_ids=[r for r, _, _ in self.cached], new_block_ids=[(b,) if b else None for _, b, _ in self.cached],
                  num_computed_tokens=[c for _, _, c in self.cached], resumed_req_ids=self.resumed)

    @property
    def num_scheduled_tokens(self):
        return self.scheduled


@pytest.fixture
def pool():
    with temp_pool(1 << 20) as p:
        yield p


def scheduler(pool, role="consumer", **kw) -> ShareScheduler:
    settings = ConnectorSettings(role, "base-A", pool.spec, kw.pop("scope", "dec"), **kw)
    return ShareScheduler(settings, pool, BS, LAYOUT)


def prompt(n, seed=0):
    return [3 + (seed * 7 + i * 13) % 1000 for i in range(n)]


def store_prompt(pool, tokens, salt="tenant-1", layout=LAYOUT, upto=None, pins=0):
    """The blocks a producer saves for ``tokens`` (all but the last token), or only the first ``upto``."""
    keys = shared_block_keys("base-A", salt, tokens, BS)[:upto]
    put(pool, [Block(k.key, bytes(64), k.num_tokens, layout, i) for i, k in enumerate(keys)], pins=pins)
    return keys


def test_a_full_match_takes_every_prompt_token_but_the_last_and_is_leased_once(pool):
    s, toks = scheduler(pool), prompt(70)  # 2 full blocks and a partial one of 5 (69 shared tokens)
    store_prompt(pool, toks)
    req = FakeRequest("r1", toks)
    assert s.get_num_new_matched_tokens(req, 0) == (69, False)
    assert s.get_num_new_matched_tokens(req, 0) == (69, False)  # asked again: still a pure read
    assert pool._db().execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0
    s.update_state_after_alloc(req, FakeBlocks([10, 11, 12, 13]), 69)
    assert pool._db().execute("SELECT COUNT(DISTINCT lease) FROM leases").fetchone()[0] == 1
    (load,) = s.build_connector_meta(FakeOutput()).loads
    assert load.block_ids == [10, 11, 12] and load.ntokens_last == 5
    assert [e.ntokens for e in load.entries] == [32, 32, 5]
    assert s.request_finished(req) == {"prefillshare": {"loaded_tokens": 69, "fallback": None}}
    assert pool.stats("dec").get("hits") == 1 and pool.stats("dec").get("hit_tokens") == 69


def test_local_hits_shift_the_run_to_the_first_block_not_computed(pool):
    s, toks = scheduler(pool), prompt(70, seed=1)
    store_prompt(pool, toks)
    req = FakeRequest("r", toks)
    assert s.get_num_new_matched_tokens(req, 32) == (37, False)
    s.update_state_after_alloc(req, FakeBlocks([5, 6, 7]), 37)
    (load,) = s.build_connector_meta(FakeOutput()).loads
    assert load.block_ids == [6, 7] and [e.ntokens for e in load.entries] == [32, 5]
    assert s.get_num_new_matched_tokens(FakeRequest("all", toks), 69) == (0, False)  # nothing left to load


@pytest.mark.parametrize("n", [1, 2])
def test_a_prompt_too_short_to_share_asks_nothing(pool, n):
    assert scheduler(pool).get_num_new_matched_tokens(FakeRequest("r", prompt(n)), 0) == (0, False)


def test_a_partial_match_is_a_miss_counted_once_when_the_request_finishes(pool):
    s, toks = scheduler(pool), prompt(100, seed=2)
    store_prompt(pool, toks, upto=2)  # 2 of 4 blocks (an eviction took the tail)
    req = FakeRequest("r", toks)
    for _ in range(3):  # vLLM may ask several times: still one miss
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    report = s.request_finished(req)["prefillshare"]
    assert report["fallback"] == "missing" and report["detail"] == "2/4 blocks in the pool"
    st = pool.stats("dec")
    assert st.get("misses") == 1 and st.fallbacks == {"missing": 1}


def test_the_tenant_salt_separates_tenants(pool):
    s, toks = scheduler(pool), prompt(70, seed=3)
    store_prompt(pool, toks, salt="tenant-a")
    assert s.get_num_new_matched_tokens(FakeRequest("a", toks, cache_salt="tenant-a"), 0) == (69, False)
    assert s.get_num_new_matched_tokens(FakeRequest("b", toks, cache_salt="tenant-b"), 0) == (0, False)
    assert s.get_num_new_matched_tokens(FakeRequest("n", toks, cache_salt=None), 0) == (0, False)


def test_per_adapter_keys_carry_the_lora_name(pool):
    toks = prompt(70, seed=4)
    store_prompt(pool, toks, salt=key_salt("tenant-1", "lora-x"))
    lora = NS(lora_name="lora-x")
    per_adapter = scheduler(pool, adapter_keys=True)
    assert per_adapter.get_num_new_matched_tokens(FakeRequest("x", toks, lora_request=lora), 0) == (69, False)
    assert per_adapter.get_num_new_matched_tokens(
        FakeRequest("y", toks, lora_request=NS(lora_name="lora-y")), 0) == (0, False)
    assert per_adapter.get_num_new_matched_tokens(FakeRequest("base", toks), 0) == (0, False)
    # without adapter keys the adapter is not part of the key: the plain tenant keys are asked for
    assert scheduler(pool).get_num_new_matched_tokens(FakeRequest("x", toks, lora_request=lora), 0) == (0, False)


def test_a_prompt_saved_in_another_layout_prefills_privately_with_its_reason(pool):
    toks = prompt(70, seed=5)
    store_prompt(pool, toks, layout="other-layout")
    s = scheduler(pool)
    req = FakeRequest("l", toks)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.request_finished(req)["prefillshare"]["detail"] == f"other-layout != {LAYOUT}"
    assert pool.stats("dec").fallbacks == {"layout": 1}


def placed(pool, seed, block_ids):
    """A consumer scheduler with one request whose whole shared prompt was matched and allocated."""
    s, toks = scheduler(pool), prompt(70, seed=seed)
    store_prompt(pool, toks)
    req = FakeRequest("r", toks)
    assert s.get_num_new_matched_tokens(req, 0) == (69, False)
    s.update_state_after_alloc(req, FakeBlocks(block_ids), 69)
    return s, req


def test_a_request_finished_before_its_load_was_sent_releases_its_lease(pool):
    s, req = placed(pool, 6, [1, 2, 3])
    s.request_finished(req)
    assert pool._db().execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0
    assert s.build_connector_meta(FakeOutput()).loads == []


def test_a_load_the_worker_found_bad_is_reported_and_counted_by_the_worker_only(pool):
    s, req = placed(pool, 7, [4, 5, 6])
    s.build_connector_meta(FakeOutput())
    s.update_connector_output(NS(invalid_block_ids={5}, finished_recving=None))
    assert s.request_finished(req)["prefillshare"] == {"loaded_tokens": 0, "fallback": "load_failed"}
    assert pool.stats("dec").get("misses") == 0  # the worker counted the failure (fallback:<kind>)


def test_a_producer_saves_prompt_minus_one_when_its_last_chunk_is_scheduled_with_fan_out_pins(pool):
    s, toks = scheduler(pool, role="producer", scope="base"), prompt(70, seed=9)
    req = FakeRequest("p", toks, kv_transfer_params={"fanout": 3})
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # a producer loads nothing
    # chunk 1 of 64 tokens: not the end of the prompt yet
    assert s.build_connector_meta(FakeOutput(new=[("p", [20, 21], 0)], scheduled={"p": 64})).saves == []
    (save,) = s.build_connector_meta(FakeOutput(cached=[("p", [22, 23], 64)], scheduled={"p": 6})).saves
    keys = shared_block_keys("base-A", "tenant-1", toks, BS)
    assert save.keys == [k.key for k in keys] and save.ntokens == [32, 32, 5]
    assert save.block_ids == [20, 21, 22] and save.pins == 3
    # decode steps after the prompt save nothing more
    assert s.build_connector_meta(FakeOutput(cached=[("p", None, 70)], scheduled={"p": 1})).saves == []
    report = s.request_finished(req)["prefillshare"]
    assert report == {"prefill_module_id": "base-A", "shared_tokens": 69, "blocks": 3, "last_key": keys[-1].key}


def test_a_producer_saves_no_in_engine_decoders_request_but_saves_other_adapters(pool, monkeypatch):
    """An in-engine LoRA decoder's request (its adapter among the engine's hand-over adapters) hands
    nothing over: its KV stays in the engine's prefix cache. Another adapter's prompt (a per-adapter
    prefill's) and the base's are saved as before."""
    from prefillshare.app.engine import vllm_plugin

    monkeypatch.setattr(vllm_plugin, "_ADAPTERS", frozenset({"ie0"}))
    s = scheduler(pool, role="producer")
    reqs = [FakeRequest("ie", prompt(40), lora_request=NS(lora_name="ie0")),
            FakeRequest("ad", prompt(40, seed=1), lora_request=NS(lora_name="ad0"), kv_transfer_params={"fanout": 1}),
            FakeRequest("base", prompt(40, seed=2), kv_transfer_params={"fanout": 1})]
    for r in reqs:
        s.on_new_request(r)
    out = FakeOutput(new=[("ie", [1, 2], 0), ("ad", [3, 4], 0), ("base", [5, 6], 0)],
                     scheduled={"ie": 40, "ad": 40, "base": 40})
    assert [save.req_id for save in s.build_connector_meta(out).saves] == ["ad", "base"]


@pytest.mark.parametrize("params,pins", [(None, 0), ({"fanout": "x"}, 0), ({"fanout": -2}, 0), ({"fanout": "2"}, 2)])
def test_fan_out_pins_come_from_kv_transfer_params_and_bad_values_pin_nothing(pool, params, pins):
    s = scheduler(pool, role="producer")
    req = FakeRequest("p", prompt(40), kv_transfer_params=params)
    s.on_new_request(req)
    (save,) = s.build_connector_meta(FakeOutput(new=[("p", [1, 2], 0)], scheduled={"p": 40})).saves
    assert save.pins == pins


def test_block_ids_are_tracked_from_scheduler_output_when_vllm_binds_no_block_manager(pool):
    """vllm 0.26 (the CUDA build matching torch 2.11, run on the H200) gives the connector no block
    manager; the ids come from the scheduler's new/cached request data, chunk by chunk."""
    s = scheduler(pool, role="producer")
    s.track_blocks(FakeOutput(new=[("a", [4, 5], 0), ("b", [9], 0)]))
    s.track_blocks(FakeOutput(cached=[("a", [6], 0), ("b", None, 0)]))
    assert s.block_ids("a") == [4, 5, 6] and s.block_ids("b") == [9]
    s.track_blocks(FakeOutput(cached=[("b", [1, 2], 0)], resumed={"b"}))  # preempted and resumed: new ids
    assert s.block_ids("b") == [1, 2] and s.block_ids("missing") == []
    # a bound block manager (vllm >= 0.27) is preferred over the tracked ids
    s.block_manager = NS(get_block_ids=lambda rid: ([7, 8],))
    assert s.block_ids("a") == [7, 8]
