"""The engine deployments as deployments/path/fanout.py calls them, over Ray Serve handles.

The one place where the request path meets Serve: a prefill call whose wait for a replica is
bounded (Serve holds a call while a deployment has no replica, e.g. its node is gone), a
decoder stream whose wait is bounded while its decoder has no replica running (it died and
restarts; a decoder whose replicas are only busy queues as Serve queues it), Serve's
back-pressure turned into :class:`Shed`, and the metrics events sent
fire-and-forget (batched by the caller's :class:`~prefillshare.deployments.metrics.MetricsSender`). The Router and the Orchestrator each hold one.
"""
from __future__ import annotations

import asyncio
import logging

from ray.serve.exceptions import BackPressureError

from prefillshare.deployments.errors import Shed, Unreachable
from prefillshare.deployments.fleet import Fleet
from prefillshare.deployments.messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillTicket, RequestRecord
from prefillshare.deployments.metrics import MetricsSender
from prefillshare.deployments.ray_internals import replica_assigned, stream_assigned
from prefillshare.deployments.routing.safe_router import running_replicas

log = logging.getLogger("ray.serve")


class _Stream:
    """A decoder's Serve stream whose back-pressure error is :class:`Shed`; with ``wait_s``, no
    replica taking the call within it is :class:`Unreachable` (``what`` names the decoder)."""

    def __init__(self, response, wait_s: float | None = None, what: str = ""):
        self._response, self._wait_s, self._what = response, wait_s, what

    def __aiter__(self):
        return self

    async def __anext__(self) -> DecodeChunk:
        try:
            if self._wait_s is not None:
                await self._assigned()
            return await self._response.__anext__()
        except BackPressureError as e:
            raise Shed(str(e)) from None

    async def _assigned(self) -> None:
        """The bounded wait for a replica, once, before the first chunk."""
        wait_s, self._wait_s = self._wait_s, None
        try:
            await asyncio.wait_for(stream_assigned(self._response), wait_s)
        except TimeoutError:
            self._response.cancel()
            raise Unreachable(f"{self._what}: no replica is running and none took the call within {wait_s} s") from None

    def cancel(self) -> None:
        self._response.cancel()


class ServeEngines:
    """``prefill``: {module: handle of its Prefill deployment}; ``decoders``: {served name:
    handle of its Decode deployment}; ``metrics``: this replica's sender to the Metrics deployment (or None)."""

    def __init__(self, prefill: dict, decoders: dict, metrics: MetricsSender | None = None,
                 fleet: Fleet | None = None):
        self._prefill = prefill
        self._decoders = {k: h.options(stream=True) for k, h in decoders.items()}
        self._wakers = dict(decoders)  # unary handles: ``ready`` starts a decoder at zero
        self._metrics = metrics
        self._fleet = fleet
        self._waking: dict[str, asyncio.Future] = {}  # deployment -> its ``ready`` call while it starts

    async def prefill(self, module: str, req: PrefillRequest, wait_s: float) -> PrefillTicket:
        resp = self._prefill[module].prefill.remote(req)
        try:
            ref = await asyncio.wait_for(replica_assigned(resp), wait_s)  # the wait for a replica
        except BackPressureError as e:
            raise Shed(str(e)) from None
        except TimeoutError:
            resp.cancel()
            raise Unreachable(f"prefill module {module}: no replica took the call within {wait_s} s") from None
        try:
            return await ref
        except BackPressureError as e:
            raise Shed(str(e)) from None

    def decoder_down(self, model: str) -> bool:
        """No replica runs and the decoder is not one its autoscaler may stop (that one is cold)."""
        name = self._decoders[model].deployment_name
        return running_replicas(name) == 0 and not (self._fleet is not None and self._fleet.can_sleep(name))

    def decoder_cold(self, model: str) -> bool:
        name = self._decoders[model].deployment_name
        return self._fleet is not None and self._fleet.cold(name, running_replicas(name))

    async def wake(self, model: str, budget_s: float) -> float | None:
        """Start a cold decoder (a call to it makes Serve's autoscaler leave zero) and wait for it up
        to ``budget_s``; None once it answers, else the seconds a start is expected to take. A start
        expected past the budget is not waited for: the call is made and the estimate returned."""
        assert self._fleet is not None, "only a fleet makes a decoder cold"
        name = self._decoders[model].deployment_name
        estimate = self._fleet.start_estimate_s(name)
        call = self._waking.get(name)
        if call is None or call.done():
            call = self._waking[name] = asyncio.ensure_future(self._wakers[model].ready.remote())
        if estimate > budget_s:
            return estimate
        try:
            await asyncio.wait_for(asyncio.shield(call), budget_s)
        except TimeoutError:
            return estimate
        except Exception as e:  # noqa: BLE001 - the replica failed to start: a start takes as long again
            log.warning("decoder %s failed to start from zero: %s: %s", model, type(e).__name__, e)
            return estimate
        return None

    def decode(self, model: str, req: DecodeRequest, wait_s: float | None) -> _Stream:
        response = self._decoders[model].generate.remote(req)  # makes this process's router for it on the first call
        if not self.decoder_down(model):
            wait_s = None  # replicas are up (or the app is starting): the call queues as Serve queues it
        return _Stream(response, wait_s, f"decoder {model}")

    def fallback(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.send("fallback", reason, 1)

    def record(self, record: RequestRecord) -> None:
        if self._metrics is not None:
            self._metrics.send("request", record)
