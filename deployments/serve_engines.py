"""The engine deployments as deployments/fanout.py calls them, over Ray Serve handles.

The one place where the request path meets Serve: a prefill call whose wait for a replica is
bounded (Serve holds a call while a deployment has no replica, e.g. its node is gone), a
decoder stream, Serve's back-pressure turned into :class:`Shed`, and the metrics events sent
fire-and-forget (batched by the caller's :class:`~deployments.metrics.MetricsSender`). The Router and the Orchestrator each hold one.
"""
from __future__ import annotations

import asyncio

from ray.serve.exceptions import BackPressureError

from deployments.errors import Shed, Unreachable
from deployments.messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillTicket
from deployments.metrics import MetricsSender, RequestRecord
from deployments.ray_internals import replica_assigned


class _Stream:
    """A decoder's Serve stream whose back-pressure error is :class:`Shed`."""

    def __init__(self, response):
        self._response = response

    def __aiter__(self):
        return self

    async def __anext__(self) -> DecodeChunk:
        try:
            return await self._response.__anext__()
        except BackPressureError as e:
            raise Shed(str(e)) from None

    def cancel(self) -> None:
        self._response.cancel()


class ServeEngines:
    """``prefill``: {module: handle of its Prefill deployment}; ``decoders``: {served name:
    handle of its Decode deployment}; ``metrics``: this replica's sender to the Metrics deployment (or None)."""

    def __init__(self, prefill: dict, decoders: dict, metrics: MetricsSender | None = None):
        self._prefill = prefill
        self._decoders = {k: h.options(stream=True) for k, h in decoders.items()}
        self._metrics = metrics

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

    def decode(self, model: str, req: DecodeRequest) -> _Stream:
        return _Stream(self._decoders[model].generate.remote(req))

    def fallback(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.send("fallback", reason, 1)

    def record(self, record: RequestRecord) -> None:
        if self._metrics is not None:
            self._metrics.send("request", record)
