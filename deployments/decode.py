"""DecodeServer: one deployment per task decoder, streaming generation.

Each replica runs a vLLM engine on the decoder with the PrefillShare connector as consumer:
for a prompt whose base KV a prefill replica published, the engine loads it and computes only
the last prompt token itself. Decoders without a compatible prefill module run without a
connector and prefill privately.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray import serve

from app.engine.async_engine import EngineConfig, EngineRequestError, Sampling
from deployments.engine_host import EngineHost
from deployments.messages import DecodeChunk, DecodeRequest


@serve.deployment(name="Decode")
class DecodeServer(EngineHost):
    async def __init__(self, model_name: str, engine_config: EngineConfig, metrics=None):
        self.model = model_name
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
                yield DecodeChunk(req.request_id, self.model, "", [], True, "error", error=f"invalid_request: {e}")
            except Exception as e:  # noqa: BLE001 - reported to the caller as this request's failure
                yield DecodeChunk(req.request_id, self.model, "", [], True, "error", error=f"engine_error: {e}")

    async def _stream(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()
        ttft = None
        sent_text = 0
        s = req.sampling
        sampling = Sampling(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                            seed=s.seed, stop_token_ids=tuple(s.stop_token_ids))
        async for out in self.engine.generate(list(req.prompt_token_ids), sampling, req.request_id,
                                              cache_salt=req.cache_salt,
                                              kv_transfer_params=req.kv_transfer_params):
            if ttft is None and (out.new_token_ids or out.finished):
                ttft = time.perf_counter() - t0
            delta = out.text[sent_text:]
            sent_text = len(out.text)
            yield DecodeChunk(
                request_id=req.request_id, model=self.model, delta_text=delta,
                delta_token_ids=list(out.new_token_ids), finished=out.finished,
                finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens, num_generated_tokens=len(out.token_ids),
                ttft_s=ttft,
            )

