"""deployments/path/serve_engines.py without a cluster: a decoder call's wait for a replica is bounded
only while its decoder has none running (Serve's handles and router faked)."""
from __future__ import annotations

import asyncio

import pytest

from prefillshare.deployments.errors import Unreachable
from prefillshare.deployments.messages import DecodeChunk
from prefillshare.deployments.path import serve_engines
from prefillshare.deployments.path.serve_engines import ServeEngines
from prefillshare.deployments.routing import safe_router


class FakeResponse:
    """A streaming call that a replica takes ``assign_after_s`` after it was made (None: never)."""

    def __init__(self, assign_after_s: float | None):
        self.assign_after_s, self.cancelled = assign_after_s, False
        self.chunk = DecodeChunk("r", "alpha", "hi", [5], True, "stop")

    async def _fetch_future_result_async(self):
        if self.assign_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.assign_after_s)

    async def __anext__(self):
        await self._fetch_future_result_async()
        return self.chunk

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    deployment_name = "Decode-alpha"

    def __init__(self, assign_after_s: float | None):
        self.assign_after_s, self.responses = assign_after_s, []
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, req):
        self.responses.append(FakeResponse(self.assign_after_s))
        return self.responses[-1]


def _first_chunk(assign_after_s, running, wait_s, monkeypatch):
    monkeypatch.setattr(serve_engines, "running_replicas", lambda name: running)
    handle = FakeHandle(assign_after_s)
    engines = ServeEngines({}, {"alpha": handle})
    stream = engines.decode("alpha", object(), wait_s)
    return asyncio.run(stream.__anext__()), handle.responses[0]


def test_a_decoder_with_no_replica_running_fails_unreachable_after_the_wait(monkeypatch):
    with pytest.raises(Unreachable, match="decoder alpha: no replica is running and none took the call within 0.05 s"):
        _first_chunk(None, 0, 0.05, monkeypatch)


def test_the_unreachable_call_is_cancelled(monkeypatch):
    monkeypatch.setattr(serve_engines, "running_replicas", lambda name: 0)
    handle = FakeHandle(None)
    stream = ServeEngines({}, {"alpha": handle}).decode("alpha", object(), 0.05)
    with pytest.raises(Unreachable):
        asyncio.run(stream.__anext__())
    assert handle.responses[0].cancelled  # Serve stops routing it: no replica gets it later


@pytest.mark.parametrize("running", [2, None])
def test_a_decoder_whose_replicas_are_up_or_not_yet_known_queues_past_the_wait(running, monkeypatch):
    """Busy replicas: the call waits for one as Serve queues it (its max_queued_requests sheds the
    rest); None: the app is starting and this process's router has not heard of a replica yet."""
    chunk, response = _first_chunk(0.3, running, 0.05, monkeypatch)
    assert chunk.delta_text == "hi" and not response.cancelled


def test_a_timeout_inside_the_stream_is_not_taken_for_a_missing_replica(monkeypatch):
    """Only the bounded wait for a replica becomes Unreachable; a TimeoutError from the stream itself stays one."""
    monkeypatch.setattr(serve_engines, "running_replicas", lambda name: 2)
    handle = FakeHandle(0.0)
    stream = ServeEngines({}, {"alpha": handle}).decode("alpha", object(), 0.05)

    async def timed_out():
        raise TimeoutError("a read inside the stream")

    handle.responses[0].__anext__ = timed_out
    with pytest.raises(TimeoutError, match="a read inside the stream"):
        asyncio.run(stream.__anext__())


def test_a_retry_waits_for_the_restarted_replica(monkeypatch):
    chunk, _ = _first_chunk(0.3, 0, None, monkeypatch)
    assert chunk.delta_text == "hi"


def test_running_replicas_reads_this_processs_router_for_the_deployment():
    class Router:  # what the project's routers expose: Serve's public replica view
        curr_replicas = {"r1": object(), "r2": object()}
        had_replicas = True

    router = Router()
    assert safe_router.running_replicas("Decode-registry-test") is None  # no call made yet from this process
    safe_router._ROUTERS["Decode-registry-test"] = router
    try:
        assert safe_router.running_replicas("Decode-registry-test") == 2
        router.curr_replicas = {}
        assert safe_router.running_replicas("Decode-registry-test") == 0
    finally:
        safe_router._ROUTERS.pop("Decode-registry-test", None)
