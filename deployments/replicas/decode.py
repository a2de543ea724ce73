"""DecodeServer: one deployment per task decoder, streaming generation.

Each replica runs a vLLM engine on the decoder with the app's hand-over (app/engine/handover.py)
as consumer: for a prompt whose base KV a prefill replica computed, the engine loads it and
computes only the last prompt token itself. The hand-over's decode side decides each request's
``kv_transfer_params`` right before the engine takes it (after any queueing: a lease with too
little time left means a private prefill) and counts what happened. Decoders without a
compatible prefill module run without a connector and prefill privately.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray import serve

from prefillshare.app.engine.async_engine import EngineConfig, EngineRequestError
from prefillshare.app.engine.handover import DecodeSide, Handover, Pull
from prefillshare.deployments.errors import ErrorCode, Failure
from prefillshare.deployments.messages import DecodeChunk, DecodeRequest
from prefillshare.deployments.replicas.engine_host import EngineHost


@serve.deployment(name="Decode")
class DecodeServer(EngineHost):
    async def __init__(self, model_name: str, engine_config: EngineConfig, handover: Handover | None, metrics=None):
        self.model = model_name
        self.decode_side = handover.decode_side() if handover is not None else DecodeSide()
        await self._start_engine(engine_config, handover, metrics)

    def _identity(self) -> dict:
        return {"model": self.model}

    async def generate(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        """Stream deltas; an engine failure ends the stream with a chunk carrying ``error``."""
        with self._in_flight():
            try:
                async for chunk in self._stream(req):
                    yield chunk
            except (EngineRequestError, ValueError) as e:
                yield self._failed(req, ErrorCode.INVALID_REQUEST, e)
            except Exception as e:  # noqa: BLE001 - reported to the caller as this request's failure
                yield self._failed(req, ErrorCode.ENGINE_ERROR, e)

    def _failed(self, req: DecodeRequest, code: ErrorCode, e: Exception) -> DecodeChunk:
        return DecodeChunk(req.request_id, req.adapter or self.model, "", [], True, "error",
                           error=Failure(code, str(e)))

    def _count(self, pull: Pull, out) -> None:
        """Count a finished request's hand-over and send the increments to /metrics."""
        events = self.decode_side.finished(pull, out.num_prompt_tokens, out.num_cached_tokens)
        if events and self.metrics is not None:
            self.metrics.send(self.decode_side.metrics_channel, self.model, events)

    async def _stream(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()
        ttft = None
        pull = self.decode_side.pull(req.lease)  # decided here, after the replica's queue
        counted = pull is None
        async for out in self.engine.generate(list(req.prompt_token_ids), req.sampling, req.request_id,
                                              cache_salt=req.cache_salt, lora=req.adapter,
                                              kv_transfer_params=pull.params if pull is not None else None):
            if pull is not None:
                out.num_cached_tokens = self.decode_side.cached_tokens(pull, out.num_prompt_tokens,
                                                                       out.num_cached_tokens)
                if out.finished and not counted:
                    self._count(pull, out)
                    counted = True  # once per request (n sequences finish one by one)
            if ttft is None and (out.new_token_ids or out.finished):
                ttft = time.perf_counter() - t0
            yield DecodeChunk(
                request_id=req.request_id, model=req.adapter or self.model, delta_text=out.new_text,
                delta_token_ids=list(out.new_token_ids), finished=out.finished,
                finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens, num_generated_tokens=out.num_generated_tokens,
                ttft_s=ttft, index=out.index, logprobs=out.new_logprobs, stop_reason=out.stop_reason,
                prompt_logprobs=out.prompt_logprobs,
            )
