"""The request path below the ingress (deployments/path/fanout.py, deployments/path/decode_call.py) with
fake engines: no Ray, no vLLM. What the Router runs for a completion and the Orchestrator for
an agent round: grouping by prefill module, locality keys and the tenant's salt, the private
fallback and its reasons, overload, node-affinity and adapters in the decode request, the
accumulated output, error chunks, kv_miss and the metrics record."""
from __future__ import annotations

import asyncio
import time

import pytest

from prefillshare.app.config import LimitsConfig
from prefillshare.app.plan import AppPlan, DecoderPlan, ModulePlan
from prefillshare.app.prompt_split import shared_length, split_prompt
from prefillshare.app.sampling import Sampling
from prefillshare.deployments.errors import ErrorCode, Failure, Shed, Unreachable
from prefillshare.deployments.messages import DecodeChunk, PrefillTicket
from prefillshare.deployments.path.decode_call import Output, Sequence
from prefillshare.deployments.path.fanout import FanOut, Leg
from prefillshare.deployments.routing.locality import locality_keys

BLOCK = 4
PLAN = AppPlan(
    tokenizer="unused",
    modules=(ModulePlan("base", "module-id-base", BLOCK),),
    decoders=(DecoderPlan("alpha", "base", None, None, 100, 64),
              DecoderPlan("ad0", "base", None, None, 100, 64, group="group", adapter="ad0"),
              DecoderPlan("private", None, "incompatible", "other base", 100, 64),
              DecoderPlan("ie0", "base", None, None, 100, 64, adapter="ie0", in_engine=True),
              DecoderPlan("ie1", "base", None, None, 100, 64, adapter="ie1", in_engine=True)),
    limits=LimitsConfig(max_tokens_default=8, max_tokens_cap=64, max_agents=4, max_rounds=2, prefill_wait_s=0.5))


class FakeStream:
    def __init__(self, chunks, fail: Exception | None = None):
        self._chunks, self._fail, self.cancelled = list(chunks), fail, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for c in self._chunks:
            yield c
        if self._fail is not None:
            raise self._fail

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngines:
    """Records every call; ``prefill_raises``/``decode_raises`` make those calls fail."""

    def __init__(self, prefill_raises: Exception | None = None, decode_raises: Exception | None = None,
                 cached: int = 7, dead_before_output: int = 0, engine_failed_before_output: int = 0,
                 prefill_fails: int | None = None):
        self.prefill_raises, self.decode_raises, self.cached = prefill_raises, decode_raises, cached
        self.dead_before_output = dead_before_output  # this many decode calls fail before any chunk
        # this many decode calls end at once with the in-band engine_error chunk of a dead engine core
        self.engine_failed_before_output = engine_failed_before_output
        self.prefill_fails = prefill_fails  # only this many prefill calls raise (None: every call)
        self.prefills: list[tuple[str, object, float]] = []
        self.decodes: list[tuple[str, object]] = []
        self.decode_waits: list[float | None] = []  # the wait_s of each decode call
        self.down: set[str] = set()  # decoders with no replica running
        self.cold: dict[str, float | None] = {}  # decoders at zero: model -> what wake() answers
        self.woken: list[tuple[str, float]] = []
        self.fallbacks: list[str] = []
        self.records: list = []

    async def prefill(self, module, req, wait_s):
        self.prefills.append((module, req, wait_s))
        if self.prefill_raises is not None and (self.prefill_fails is None or self.prefill_fails > 0):
            if self.prefill_fails is not None:
                self.prefill_fails -= 1
            raise self.prefill_raises
        return PrefillTicket(module, "replica-1", num_computed_tokens=11, node_id="node-a")

    def decoder_down(self, model):
        return model in self.down

    def decoder_cold(self, model):
        return model in self.cold

    async def wake(self, model, budget_s):
        self.woken.append((model, budget_s))
        return self.cold[model]

    def decode(self, model, req, wait_s):
        self.decodes.append((model, req))
        self.decode_waits.append(wait_s)
        rid = req.request_id
        chunks = [DecodeChunk(rid, model, "he", [5], False, num_cached_tokens=self.cached),
                  DecodeChunk(rid, model, "llo", [6, 7], True, "stop", num_cached_tokens=self.cached, stop_reason="x")]
        if self.dead_before_output > 0:
            self.dead_before_output -= 1
            return FakeStream([], ConnectionError("replica died"))
        if self.engine_failed_before_output > 0:
            self.engine_failed_before_output -= 1
            return FakeStream([DecodeChunk(rid, model, "", [], True, "error",
                                           error=Failure(ErrorCode.ENGINE_ERROR, "EngineDeadError: core died"))])
        return FakeStream(chunks[:1] if self.decode_raises else chunks, self.decode_raises)

    def fallback(self, reason):
        self.fallbacks.append(reason)

    def record(self, record):
        self.records.append(record)


def _leg(model: str, prompt, rid: str = "d-1", agent: str = "") -> Leg:
    return Leg(rid, model, tuple(prompt), Sampling(max_tokens=4), agent)


def _run(coro):
    return asyncio.run(coro)


async def _drain(call) -> list[DecodeChunk]:
    return [c async for c in call.chunks()]


def test_one_prefill_per_module_routed_on_the_shared_context_with_the_tenant_salt():
    engines = FakeEngines()
    fan = FanOut(PLAN, engines)
    shared = list(range(10, 22))
    legs = [_leg("alpha", shared + [1, 2], "d-a", "a"), _leg("ad0", shared + [3], "d-b", "b")]
    plans = _run(fan.prepare(legs, "run-r0", "agents", "salt-t"))
    [(module, req, wait_s)] = engines.prefills
    assert (module, req.request_id, wait_s) == ("base", "run-r0-base", PLAN.limits.prefill_wait_s)
    assert req.shared_prefix == tuple(shared) and req.prompts == (legs[0].prompt, legs[1].prompt)
    assert req.locality_keys == locality_keys("module-id-base", shared, BLOCK, "salt-t") and req.cache_salt == "salt-t"
    assert req.adapters == (None, None)  # neither decoder asks the module for its own adapter's KV
    assert [p.request.request_id for p in plans] == ["d-a", "d-b"]
    for p, leg in zip(plans, legs):
        assert p.error is None and p.ticket.replica_id == "replica-1" and p.route == "agents" and p.agent == leg.agent
        assert p.request.prefer_node == "node-a" and p.request.cache_salt == "salt-t"
        assert p.shared_tokens_expected == shared_length(len(leg.prompt))
    assert (plans[0].request.adapter, plans[1].request.adapter) == (None, "ad0")
    assert engines.fallbacks == []


def test_a_single_prompt_routes_on_its_handed_over_part_and_salts_differ_by_tenant():
    prompt = list(range(30, 43))
    keys = {}
    for salt in ("t1", "t2"):
        engines = FakeEngines()
        _run(FanOut(PLAN, engines).prepare([_leg("alpha", prompt)], "cmpl-1", "completions", salt))
        keys[salt] = engines.prefills[0][1].locality_keys
        assert keys[salt] == locality_keys("module-id-base", split_prompt(prompt)[0], BLOCK, salt)
    assert keys["t1"] and keys["t1"] != keys["t2"]


def test_in_engine_decoders_need_no_prefill_call_and_route_with_the_fan_outs_keys():
    """An in-engine decoder's request goes to its module's engine, which reads its own prefix cache:
    no prefill call for it, and every call of the fan-out carries the module's locality keys (the
    prefix router keeps them on one replica)."""
    engines = FakeEngines()
    shared = list(range(10, 22))
    legs = [_leg("ie0", shared + [1, 2], "d-0", "a"), _leg("ie1", shared + [3], "d-1", "b")]
    plans = _run(FanOut(PLAN, engines).prepare(legs, "run-r0", "agents", "salt-t"))
    assert engines.prefills == [] and engines.fallbacks == []
    keys = locality_keys("module-id-base", shared, BLOCK, "salt-t")
    for p, name in zip(plans, ("ie0", "ie1")):
        assert p.error is None and p.ticket is None and p.model == name
        assert p.request.adapter == name and p.request.locality_keys == keys and p.request.cache_salt == "salt-t"
        assert p.request.handoff is None and p.request.prefer_node is None
    # beside a decoder fed the hand-over: one prefill call for it, on the same keys as the in-engine legs
    engines = FakeEngines()
    legs.append(_leg("alpha", shared + [7], "d-2", "c"))
    plans = _run(FanOut(PLAN, engines).prepare(legs, "run-r1", "agents", "salt-t"))
    [(module, req, _)] = engines.prefills
    assert module == "base" and req.prompts == (legs[2].prompt,) and req.locality_keys == keys
    assert [p.request.locality_keys for p in plans] == [keys, keys, ()]
    assert plans[2].ticket is not None and plans[0].ticket is None


def test_private_decoders_skip_prefill_and_count_their_reason():
    engines = FakeEngines()
    [plan] = _run(FanOut(PLAN, engines).prepare([_leg("private", [1, 2, 3, 4, 5])], "c", "completions", None))
    assert engines.prefills == [] and engines.fallbacks == ["incompatible"]
    assert plan.ticket is None and plan.request.prefer_node is None and plan.shared_tokens_expected == 0


@pytest.mark.parametrize("raised, reasons", [(Unreachable("gone"), ["prefill_unavailable"]),
                                             (RuntimeError("boom"), ["prefill_retry", "prefill_error"])])
def test_a_failed_or_unreachable_prefill_degrades_to_private_prefill(raised, reasons):
    engines = FakeEngines(prefill_raises=raised)
    [plan] = _run(FanOut(PLAN, engines).prepare([_leg("alpha", [1, 2, 3, 4, 5])], "c", "completions", None))
    assert engines.fallbacks == reasons
    assert len(engines.prefills) == len(reasons)  # a dead replica's call is repeated once; an unreachable one is not
    assert plan.error is None and plan.ticket is None and plan.shared_tokens_expected == 0


def test_a_prefill_whose_replica_died_is_repeated_once_and_its_legs_share_the_kv():
    """The replica died under the call (it never handed over): the repeat goes to a survivor and
    every leg gets its ticket, as if nothing had happened."""
    engines = FakeEngines(prefill_raises=RuntimeError("ActorDiedError"), prefill_fails=1)
    shared = list(range(10, 22))
    plans = _run(FanOut(PLAN, engines).prepare([_leg("alpha", shared + [1], "d-a"), _leg("ad0", shared + [3], "d-b")],
                                               "r", "agents", None))
    assert engines.fallbacks == ["prefill_retry"] and len(engines.prefills) == 2
    assert engines.prefills[0][1] == engines.prefills[1][1]  # the same request, keys and salt
    assert all(p.ticket is not None and p.error is None for p in plans)


def test_a_shed_prefill_fails_its_legs_as_overloaded_without_decoding():
    engines = FakeEngines(prefill_raises=Shed("queue full"))
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("alpha", [1, 2, 3, 4, 5])], "c", "completions", None))
    assert plan.error.code is ErrorCode.OVERLOADED and "queue full" in plan.error.message
    chunks = _run(_drain(call := fan.decode(plan, 0.0)))
    assert engines.decodes == [] and [c.error for c in chunks] == [plan.error] and chunks[0].finished
    assert call.output.error == plan.error and engines.records == []  # shed before any decoder: no record


def test_decoding_accumulates_deltas_stamps_the_prefill_and_records_the_request():
    engines = FakeEngines(cached=9)
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("ad0", list(range(1, 12)), agent="x")], "c", "chat", None))
    out = Output()
    chunks = _run(_drain(fan.decode(plan, 0.0, out)))
    assert [c.prefill_replica for c in chunks] == ["replica-1", "replica-1"]
    q = out.seq(0)
    assert (q.text, q.num_chars, q.token_ids, q.finish_reason, q.stop_reason) == ("hello", 5, [5, 6, 7], "stop", "x")
    assert out.num_generated == 3 and out.num_cached_tokens == 9 and out.ttft_s is not None
    assert (out.prefill_module, out.prefill_replica) == ("base", "replica-1")
    [rec] = engines.records
    assert (rec.model, rec.agent, rec.route, rec.ok, rec.generated_tokens, rec.shared_tokens_loaded) == (
        "ad0", "x", "chat", True, 3, 9)
    assert engines.fallbacks == []


def test_a_decoder_that_loads_none_of_the_shared_kv_counts_a_kv_miss():
    engines = FakeEngines(cached=0)
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    _run(_drain(fan.decode(plan, 0.0)))
    assert engines.fallbacks == ["kv_miss"]


@pytest.mark.parametrize("raised, code", [(Shed("full"), ErrorCode.OVERLOADED),
                                          (ConnectionError("dead"), ErrorCode.DECODER_UNAVAILABLE)])
def test_a_decoder_failing_mid_stream_ends_with_one_typed_error_chunk(raised, code):
    engines = FakeEngines(decode_raises=raised)
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    call = fan.decode(plan, 0.0)
    chunks = _run(_drain(call))
    assert [c.delta_text for c in chunks] == ["he", ""] and chunks[-1].error.code is code and chunks[-1].finished
    assert call.output.error.code is code and call.output.seq(0).text == "he"
    assert engines.records[0].ok is False and engines.fallbacks == []  # a failed call is no kv_miss


async def _until_failure(call) -> list:
    """Read as the Router does: stop at the first failure chunk, leaving the generator suspended."""
    out = []
    async for chunk in call.chunks():
        out.append(chunk)
        if chunk.error:
            break
    return out


def test_a_failed_call_is_recorded_when_its_reader_stops_at_the_failure():
    """The Router stops reading a decoder call at its failure chunk (its stream ends there), so the
    call records itself before that chunk: /metrics counts the error, once."""
    engines = FakeEngines(decode_raises=ConnectionError("dead"))
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    call = fan.decode(plan, 0.0)
    chunks = _run(_until_failure(call))
    assert chunks[-1].error.code is ErrorCode.DECODER_UNAVAILABLE
    assert [r.ok for r in engines.records] == [False]


def test_a_decoder_that_died_before_any_output_is_retried_once_then_fails_typed():
    engines = FakeEngines(dead_before_output=1)
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    call = fan.decode(plan, time.perf_counter())
    chunks = _run(_drain(call))
    assert [c.delta_text for c in chunks] == ["he", "llo"] and call.output.error is None
    assert [req.request_id for _, req in engines.decodes] == ["d-1", "d-1-retry"]
    assert engines.fallbacks == ["decoder_retry"] and engines.records[0].ok
    # a new call waits limits.decoder_wait_s for a replica; the retry, already admitted, waits for the
    # restart as long as the request's timeout leaves it
    first, retry = engines.decode_waits
    assert first == PLAN.limits.decoder_wait_s and 0 < retry <= PLAN.limits.request_timeout_s

    late = FakeEngines(dead_before_output=1)  # the request's time is up when its replica dies
    fan = FanOut(PLAN, late)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    _run(_drain(fan.decode(plan, time.perf_counter() - PLAN.limits.request_timeout_s - 1)))
    assert late.decode_waits == [PLAN.limits.decoder_wait_s, 0.0]  # the retry may not wait at all

    twice = FakeEngines(dead_before_output=2)
    fan = FanOut(PLAN, twice)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    call = fan.decode(plan, 0.0)
    chunks = _run(_drain(call))
    assert len(chunks) == 1 and chunks[0].error.code is ErrorCode.DECODER_UNAVAILABLE
    assert len(twice.decodes) == 2 and twice.fallbacks == ["decoder_retry"]  # one retry, never more


def test_an_engine_that_failed_before_any_output_is_retried_once_then_its_error_is_told():
    engines = FakeEngines(engine_failed_before_output=1)
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    call = fan.decode(plan, time.perf_counter())
    chunks = _run(_drain(call))
    assert [c.delta_text for c in chunks] == ["he", "llo"] and call.output.error is None
    assert [req.request_id for _, req in engines.decodes] == ["d-1", "d-1-retry"]
    assert engines.fallbacks == ["decoder_retry"]

    twice = FakeEngines(engine_failed_before_output=2)
    fan = FanOut(PLAN, twice)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    chunks = _run(_drain(fan.decode(plan, 0.0)))
    assert len(chunks) == 1 and chunks[0].error.code is ErrorCode.ENGINE_ERROR and "core died" in chunks[0].error.message
    assert len(twice.decodes) == 2 and twice.fallbacks == ["decoder_retry"]


def test_a_leg_whose_decoder_has_no_replica_fails_before_its_prefill_and_the_others_run():
    engines = FakeEngines()
    engines.down = {"alpha"}
    fan = FanOut(PLAN, engines)
    shared = list(range(10, 22))
    plans = _run(fan.prepare([_leg("alpha", shared + [1], "d-a"), _leg("ad0", shared + [3], "d-b")], "r", "agents",
                             None))
    assert plans[0].error.code is ErrorCode.DECODER_UNAVAILABLE and "no replica is running" in plans[0].error.message
    [(module, req, _)] = engines.prefills  # one prefill, for the leg that can be decoded only
    assert req.prompts == (tuple(shared + [3]),) and plans[1].error is None and plans[1].ticket is not None
    chunks = _run(_drain(fan.decode(plans[0], time.perf_counter())))
    assert len(chunks) == 1 and chunks[0].error.code is ErrorCode.DECODER_UNAVAILABLE
    assert [m for m, _ in engines.decodes] == []  # never sent to the decoder


def test_a_cold_decoder_is_woken_before_its_prefill_and_then_runs():
    engines = FakeEngines()
    engines.cold = {"alpha": None}  # at zero; wake() answers once a replica is up
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    assert engines.woken == [("alpha", 0.75 * PLAN.limits.request_timeout_s)]  # WAKE_SHARE of the deadline
    assert plan.error is None and len(engines.prefills) == 1
    assert _run(_drain(fan.decode(plan, 0.0)))[-1].finish_reason == "stop"


def test_a_cold_decoder_whose_start_does_not_fit_fails_with_its_start_as_retry_after_before_any_prefill():
    engines = FakeEngines()
    engines.cold = {"alpha": 83.2}  # the measured start, past the budget
    fan = FanOut(PLAN, engines)
    shared = list(range(10, 22))
    plans = _run(fan.prepare([_leg("alpha", shared + [1], "d-a"), _leg("ad0", shared + [3], "d-b")], "r", "agents",
                             None))
    err = plans[0].error
    assert err.code is ErrorCode.DECODER_UNAVAILABLE and err.retry_after_s == 84 and "scaled to zero" in err.message
    [(_, req, _)] = engines.prefills
    assert req.prompts == (tuple(shared + [3]),) and plans[1].error is None


def test_a_decoder_with_no_replica_in_time_fails_as_unavailable_and_is_not_retried():
    engines = FakeEngines(decode_raises=Unreachable("decoder alpha: no replica is running"))
    engines.decode = _unreachable_decode(engines)
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    chunks = _run(_drain(fan.decode(plan, 0.0)))
    assert len(chunks) == 1 and chunks[0].error.code is ErrorCode.DECODER_UNAVAILABLE
    assert "no replica is running" in chunks[0].error.message
    assert len(engines.decodes) == 1 and engines.fallbacks == []  # a retry would only wait again


def _unreachable_decode(engines: FakeEngines):
    def decode(model, req, wait_s):
        engines.decodes.append((model, req))
        return FakeStream([], engines.decode_raises)
    return decode


def test_cancel_stops_the_decoder_stream():
    engines = FakeEngines()
    fan = FanOut(PLAN, engines)
    [plan] = _run(fan.prepare([_leg("alpha", list(range(1, 12)))], "c", "completions", None))
    call = fan.decode(plan, 0.0)

    async def first_then_cancel():
        gen = call.chunks()
        await gen.__anext__()
        call.cancel()
        await gen.aclose()

    _run(first_then_cancel())
    assert call._stream.cancelled


def test_sequence_text_can_be_replaced_after_reading_a_tool_call():
    q = Sequence()
    for t in ("a", "b", "c"):
        q.add(DecodeChunk("r", "m", t, [1], False))
    assert q.text == "abc" and q.num_chars == 3
    q.text = "x"
    q.add(DecodeChunk("r", "m", "y", [2], True, "stop"))
    assert (q.text, q.num_chars, q.finish_reason) == ("xy", 2, "stop")


def test_the_request_path_library_imports_no_ray():
    """Ray stays behind deployments/path/serve_engines.py: the library's own modules never import it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "deployments" / "path"
    for name in ("fanout.py", "decode_call.py", "engines.py"):
        tree = ast.parse((root / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m == "ray" or m.startswith("ray.") for m in imported), (name, sorted(imported))
