"""The Router bounds a whole request by ``limits.request_timeout_s`` from its admission: a request
still waiting then (a queue behind a restarting replica, a stalled stream) gets the typed error
``timeout`` (504, or in-band once its stream has started), its engine call is cancelled and its
admission slot is counted as failed. Without Ray: the Router's class with fake calls."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from prefillshare.app.config import LimitsConfig
from prefillshare.deployments.errors import ApiError
from prefillshare.deployments.fleet import Fleet
from prefillshare.deployments.ingress.admission import Admission, LatencyLimit
from prefillshare.deployments.ingress.server import Router


class _Events:
    def __init__(self):
        self.sent: list[tuple] = []

    def send(self, method, *args):
        self.sent.append((method, *args))

    gauge = send


class _Call:
    """A stream that sends ``items`` and then hangs until it is cancelled."""

    def __init__(self, items=(), hang_s: float = 3600.0):
        self.items, self.hang_s, self.cancelled = list(items), hang_s, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        await asyncio.sleep(self.hang_s)
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


# the Router class itself, under Serve's ingress wrapper (whose async __del__ a bare instance would leave unawaited)
_ROUTER = next(c for c in Router.func_or_class.__mro__ if c.__name__ == "Router" and "__del__" not in vars(c))


async def _no_details():
    return {}


def _router(timeout_s: float, admission: Admission | None = None):
    r = object.__new__(_ROUTER)
    r.limits = LimitsConfig(request_timeout_s=timeout_s)
    r.admission = admission or Admission(4)
    r.events = _Events()
    r.replica, r._published_limit = "replica-0", r.admission.limit
    r.fleet = Fleet({}, _no_details)  # no engine deployment to be short of
    return r


async def _events(head, call):
    yield f"data: {head}\n\n"
    async for item in call:
        yield f"data: {item}\n\n"


async def _collect(head, call):
    return [head] + [item async for item in call]


def test_a_request_with_no_answer_by_its_deadline_gets_504_timeout_and_its_call_is_cancelled():
    r, call = _router(0.2), _Call()

    async def run():
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ApiError) as e:
            await r._serve("completions", time.monotonic(), lambda: call, False, _events, _collect)
        return e.value, asyncio.get_running_loop().time() - t0

    err, waited = asyncio.run(run())
    assert 0.2 <= waited < 2.0
    assert (err.status, err.code, err.type) == (504, "timeout", "server_error")
    assert err.headers == {"Retry-After": "1"} and "request_timeout_s" in err.message
    assert call.cancelled
    assert r.admission.snapshot()["outcomes"] == {"completions": {"completed": 0, "failed": 1, "cancelled": 0}}
    assert r.admission.inflight == 0
    assert ("timeout", "completions") in r.events.sent


def test_a_collected_answer_that_stalls_after_its_first_item_times_out_too():
    r, call = _router(0.2), _Call(items=["a", "b"])
    with pytest.raises(ApiError) as e:
        asyncio.run(r._serve("chat", time.monotonic(), lambda: call, False, _events, _collect))
    assert e.value.status == 504 and call.cancelled


def test_a_stalled_stream_ends_with_an_in_band_timeout_then_done():
    r, call = _router(0.3), _Call(items=["first", "second"])

    async def run():
        resp = await r._serve("agents", time.monotonic(), lambda: call, True, _events, _collect)
        return [chunk async for chunk in resp.body_iterator]

    chunks = asyncio.run(run())
    assert chunks[:2] == ["data: first\n\n", "data: second\n\n"]
    error = json.loads(chunks[2].removeprefix("data: "))["error"]
    assert error["code"] == "timeout" and error["type"] == "server_error"
    assert chunks[3:] == ["data: [DONE]\n\n"]
    assert call.cancelled
    assert r.admission.snapshot()["outcomes"]["agents"]["failed"] == 1 and r.admission.inflight == 0


def test_an_answer_within_its_deadline_is_untouched():
    r, call = _router(5.0), _Call(items=["a", "b"], hang_s=0.05)
    assert asyncio.run(r._serve("completions", time.monotonic(), lambda: call, False, _events, _collect)) == ["a", "b"]
    assert not call.cancelled
    assert r.admission.snapshot()["outcomes"]["completions"]["completed"] == 1
    assert not [e for e in r.events.sent if e[0] == "timeout"]


def test_slow_answers_shrink_the_admission_limit_and_the_router_sheds_past_it():
    """Answers that take longer than the target shrink the limit (published as a gauge); a request
    beyond the smaller limit gets 429 while the old limit would have admitted it."""
    r = _router(5.0, Admission(8, LatencyLimit(8, 2, target_s=0.01, window=4)))

    async def run():
        for _ in range(4):  # each answer takes 30 ms, past the 10 ms target
            await r._serve("completions", time.monotonic(), lambda: _Late(0.03), False, _events, _collect)
        held = [asyncio.create_task(r._serve("completions", time.monotonic(), lambda: _Call(items=["a"]), False, _events,
                                             _collect)) for _ in range(6)]
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as e:
            await r._serve("completions", time.monotonic(), lambda: _Call(items=["a"]), False, _events, _collect)
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        return e.value

    err = asyncio.run(run())
    # 4 slow answers took it to 6; the 6 admitted then were still unanswered past the target when the
    # next request came, which took it to 4 at once
    assert r.admission.limit == 4 and {("admission", "replica-0", 6), ("admission", "replica-0", 4)} <= set(r.events.sent)
    assert (err.status, err.code) == (429, "overloaded") and "4 requests in flight" in err.message
    assert r.admission.inflight == 0


class _Late(_Call):
    """One item, after ``delay_s``."""

    def __init__(self, delay_s: float):
        super().__init__(items=["a"], hang_s=0)
        self.delay_s = delay_s

    async def __anext__(self):
        if self.items:
            await asyncio.sleep(self.delay_s)
        return await super().__anext__()


def test_an_engine_queue_that_sheds_a_request_counts_as_too_slow():
    """A decoder call answered `overloaded` (its engine's queue was full) becomes 429 to the client
    and counts as past the target, as a timeout does: two such answers shrink the bound."""
    from prefillshare.deployments.errors import ErrorCode, Failure
    from prefillshare.deployments.messages import DecodeChunk

    r = _router(5.0, Admission(8, LatencyLimit(8, 2, target_s=60.0, window=2)))
    shed = DecodeChunk("rq", "alpha", "", [], True, error=Failure(ErrorCode.OVERLOADED, "queue full"))
    for _ in range(2):
        with pytest.raises(ApiError) as e:
            asyncio.run(r._serve("completions", time.monotonic(), lambda: _Call(items=[shed]), False, _events, _collect))
        assert e.value.status == 429
    assert r.admission.limit == 6 and ("admission", "replica-0", 6) in r.events.sent


class _Dead(_Call):
    """A call whose replica died: RayActorError at its first item, or after ``after`` items."""

    def __init__(self, items=(), after: int = 0):
        super().__init__(items)
        self.after = after

    async def __anext__(self):
        from ray.exceptions import ActorDiedError

        if self.after == 0:
            raise ActorDiedError()
        self.after -= 1
        return await super().__anext__()


def _calls(*calls):
    made = list(calls)
    return lambda: made.pop(0)


def test_an_agent_run_whose_replica_died_before_its_first_item_is_made_once_more():
    """docs/reliability.md: the Router repeats an agent run (a call to the Orchestrator) whose
    replica died before anything was sent; a completion's retries are its decoder call's own."""
    r = _router(5)
    got = asyncio.run(r._serve("agents", time.monotonic(), _calls(_Dead(), _Call(items=["a"], hang_s=0)), False, _events, _collect,
                               repeatable=True))
    assert got == ["a"] and ("fallback", "router_retry", 1) in r.events.sent
    r = _router(5)
    with pytest.raises(ApiError) as e:  # not repeatable: 503 at once, the second call never made
        asyncio.run(r._serve("completions", time.monotonic(), _calls(_Dead(), _Call(items=["a"], hang_s=0)), False, _events,
                             _collect))
    assert e.value.status == 503 and ("fallback", "router_retry", 1) not in r.events.sent
    r = _router(5)
    with pytest.raises(ApiError) as e:  # died twice: 503, no third call
        asyncio.run(r._serve("agents", time.monotonic(), _calls(_Dead(), _Dead()), False, _events, _collect, repeatable=True))
    assert e.value.status == 503


def test_a_collected_agent_run_whose_replica_died_mid_answer_is_made_once_more():
    r = _router(5)
    got = asyncio.run(r._serve("agents", time.monotonic(), _calls(_Dead(items=["x", "y"], after=1), _Call(items=["a", "b"], hang_s=0)),
                               False, _events, _collect, repeatable=True))
    assert got == ["a", "b"] and r.events.sent.count(("fallback", "router_retry", 1)) == 1


def _request(headers: dict[str, str], body: bytes = b'{"model": "m", "prompt": "p"}'):
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope, receive)


def test_the_router_starts_a_request_s_clock_at_the_front_proxy_s_stamp_only_when_configured():
    from prefillshare.deployments.ingress.schemas import CompletionBody

    stamp = {"X-Request-Start": f"t={time.time() - 3:.3f}"}
    r = _router(60.0)
    r.keys = None
    _, _, arrived = asyncio.run(r._accept(_request(stamp), CompletionBody))
    assert time.monotonic() - arrived < 0.5  # not configured: a client's header is not trusted
    r.limits = LimitsConfig(request_timeout_s=60.0, request_start_header="x-request-start")
    _, _, arrived = asyncio.run(r._accept(_request(stamp), CompletionBody))
    assert 2.9 < time.monotonic() - arrived < 3.5
    _, _, arrived = asyncio.run(r._accept(_request({}), CompletionBody))
    assert time.monotonic() - arrived < 0.5


def test_admission_holds_on_a_crash_but_not_on_an_autoscaler_downscale():
    """The Router's hold reads the fleet: a deployment that lost a replica its autoscaler still
    wants shrinks the bound once; one the autoscaler shrank on purpose does not."""
    from prefillshare.deployments.fleet import ReplicaBounds

    def details(target, running):
        return {"Decode-a": {"target_num_replicas": target,
                             "replicas": [{"replica_id": f"r{i}", "state": "RUNNING"} for i in range(running)]}}

    r = _router(5.0, Admission(8, LatencyLimit(8, 1, 5.0)))
    r.fleet = Fleet({"Decode-a": ReplicaBounds(1, 3, True)}, _no_details)
    r.fleet.observe(details(3, 3))
    r._release(r._admit("completions", time.monotonic()), "completed")
    assert r.admission.limit == 8
    r.fleet.observe(details(2, 3))  # the autoscaler lowered its target; a replica drains
    r.fleet.observe(details(2, 2))
    r._release(r._admit("completions", time.monotonic()), "completed")
    assert r.admission.limit == 8  # a deliberate downscale is no fault
    r.fleet.observe(details(2, 1))  # a crash: the target stays at 2
    r._release(r._admit("completions", time.monotonic()), "completed")
    assert r.admission.limit < 8
