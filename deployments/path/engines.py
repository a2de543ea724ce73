"""The engine deployments as the request path calls them (:class:`Engines`), without Ray: the
Serve handles implement it (deployments/path/serve_engines.py), tests give fakes."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from prefillshare.deployments.messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillTicket, RequestRecord


class DecodeStream(Protocol):
    """A decoder's answer to one request: its chunks, and a way to stop it."""

    def __aiter__(self) -> AsyncIterator[DecodeChunk]: ...

    def cancel(self) -> None: ...


class Engines(Protocol):
    """The engine deployments and the metrics sink, as the path calls them."""

    async def prefill(self, module: str, req: PrefillRequest, wait_s: float) -> PrefillTicket:
        """Raises :class:`Shed` when the module's queue is full, :class:`Unreachable` when no
        replica took the call within ``wait_s``; any other exception is a failed prefill."""
        ...

    def decoder_down(self, model: str) -> bool:
        """The decoder has no replica running, as far as this process knows (False when unsure)."""
        ...

    def decoder_cold(self, model: str) -> bool:
        """The decoder's autoscaler stopped its last replica (``min_replicas: 0``): a request starts one."""
        ...

    async def wake(self, model: str, budget_s: float) -> float | None:
        """Start a cold decoder and wait for it up to ``budget_s``: None once it answers, else the
        seconds its start is expected to take (the caller's Retry-After)."""
        ...

    def decode(self, model: str, req: DecodeRequest, wait_s: float | None) -> DecodeStream:
        """The decoder's stream; iterating it raises :class:`Shed` when its queue is full and
        :class:`Unreachable` when the decoder has no replica running and none took the call within
        ``wait_s`` (None: the call waits for one as long as it takes)."""
        ...

    def fallback(self, reason: str) -> None: ...

    def record(self, record: RequestRecord) -> None: ...
