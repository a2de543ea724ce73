"""DecodeServer: one deployment per task decoder, streaming generation.

Each replica runs a vLLM engine on the decoder with the app's hand-over (app/engine/handover.py)
as consumer: for a prompt whose base KV a prefill replica computed, the engine loads it and
computes only the last prompt token itself. The hand-over's decode side decides each request's
``kv_transfer_params`` from the request's hand-off right before the engine takes it (after any
queueing: vllm-nixl's lease with too little time left means a private prefill) and counts what
happened. Decoders without a
compatible prefill module run without a connector and prefill privately.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from prefillshare.app.engine.async_engine import EngineConfig
from prefillshare.app.engine.handover import DecodeSide, Handover, Pull
from prefillshare.deployments.messages import DecodeChunk, DecodeRequest
from prefillshare.deployments.replicas.engine_host import EngineHost


@serve.deployment(name="Decode")
class DecodeServer(EngineHost):
    # Ray Serve awaits an async constructor; the type checker knows only synchronous ones
    async def __init__(self, model_name: str, engine_config: EngineConfig,  # type: ignore[misc]
                       handover: Handover | None, metrics=None):
        self.model = model_name
        self.decode_side = handover.decode_side() if handover is not None else DecodeSide()
        await self._start_engine(engine_config, handover, metrics)

    def _identity(self) -> dict:
        return {"model": self.model}

    def _count(self, pull: Pull, chunk: DecodeChunk) -> None:
        """Count a finished request's hand-over and send the increments to /metrics."""
        events = self.decode_side.finished(pull, chunk.num_prompt_tokens, chunk.num_cached_tokens)
        if events and self.metrics is not None:
            self.metrics.send("handover_events", self.model, events)

    async def _stream(self, req: DecodeRequest, kv_transfer_params: dict | None = None) -> AsyncIterator[DecodeChunk]:
        pull = self.decode_side.pull(req.handoff)  # decided here, after the replica's queue
        counted = pull is None
        async for chunk in super()._stream(req, pull.params if pull is not None else None):
            if pull is not None:
                chunk.num_cached_tokens = self.decode_side.cached_tokens(pull, chunk.num_prompt_tokens,
                                                                         chunk.num_cached_tokens)
                if chunk.finished and not counted:
                    self._count(pull, chunk)
                    counted = True  # once per request (n sequences finish one by one)
            yield chunk
