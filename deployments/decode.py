"""DecodeServer: one deployment per task decoder, streaming generation.

Each replica runs a vLLM engine on the decoder with the hand-over mode's connector as consumer:
for a prompt whose base KV a prefill replica computed, the engine loads it and computes only
the last prompt token itself. Hand-over "vllm-nixl": the request carries the prefill's lease,
checked here right before the engine takes the request (after any queueing): too little lease
left and the decoder prefills privately, counted by reason. Decoders without a compatible
prefill module run without a connector and prefill privately.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray import serve

from app.engine import vllm_nixl_handover as nixl_handover
from app.engine.async_engine import EngineConfig, EngineRequestError
from app.engine.vllm_nixl import lease_duration
from app.handover import shared_length
from deployments.engine_host import EngineHost
from deployments.errors import ErrorCode, Failure
from deployments.messages import DecodeChunk, DecodeRequest


@serve.deployment(name="Decode")
class DecodeServer(EngineHost):
    async def __init__(self, model_name: str, engine_config: EngineConfig, metrics=None):
        self.model = model_name
        lease_s = lease_duration(engine_config.kv_transfer_config)  # None: the pool's hand-over
        self.lease_margin_s = None if lease_s is None else nixl_handover.default_margin(lease_s)
        self.handover_counters = nixl_handover.HandoverCounters()
        self._vllm_nixl_deltas = nixl_handover.CounterDeltas()
        await self._start_engine(engine_config, metrics)

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

    def _count_pull(self, reason: str | None, out) -> None:
        """Count a vllm-nixl request and send its event, and vLLM's NIXL counters' increments, to /metrics."""
        event = nixl_handover.count_decode(self.handover_counters, reason, out.num_prompt_tokens,
                                           out.num_cached_tokens)
        if self.metrics is not None:
            events = {event: 1, **self._vllm_nixl_deltas(nixl_handover.read_vllm_nixl_counters())}
            self.metrics.send("vllm_nixl", self.model, events)

    async def _stream(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()
        ttft = None
        params = reason = None
        pulls = self.lease_margin_s is not None and req.lease is not None
        if pulls:  # the lease is checked here, after the replica's queue
            params, reason = nixl_handover.pull_params(req.lease, self.lease_margin_s)
        async for out in self.engine.generate(list(req.prompt_token_ids), req.sampling, req.request_id,
                                              cache_salt=req.cache_salt, kv_transfer_params=params, lora=req.adapter):
            if params is not None:
                # vLLM counts the pulled last prompt token as cached too, though the decoder recomputes
                # it with its own weights: the base's part is the hand-over convention's L-1, as in the pool
                out.num_cached_tokens = min(out.num_cached_tokens, shared_length(out.num_prompt_tokens))
            if pulls and out.finished:
                pulls = False  # once per request (n sequences finish one by one)
                self._count_pull(reason, out)
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
