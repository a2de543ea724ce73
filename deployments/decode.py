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

from app.engine.async_engine import Engine, EngineConfig, EngineRequestError, Sampling
from deployments.messages import DecodeChunk, DecodeRequest


@serve.deployment(name="Decode")
class DecodeServer:
    async def __init__(self, model_name: str, engine_config: EngineConfig, metrics=None):
        self.model = model_name
        self.engine = await Engine.start(engine_config)
        self.metrics = metrics
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.deployment = ctx.deployment
        self.in_flight = 0

    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queue.remote(self.deployment, self.replica_id, self.in_flight)

    async def generate(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        """Stream deltas; an engine failure ends the stream with a chunk carrying ``error``."""
        self.in_flight += 1
        self._report_queue()
        t0 = time.perf_counter()
        ttft = None
        sent_text = 0
        s = req.sampling
        try:
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
        except (EngineRequestError, ValueError) as e:
            yield DecodeChunk(req.request_id, self.model, "", [], True, "error", error=f"invalid_request: {e}")
        except Exception as e:  # noqa: BLE001 - reported to the caller as this request's failure
            yield DecodeChunk(req.request_id, self.model, "", [], True, "error", error=f"engine_error: {e}")
        finally:
            self.in_flight -= 1
            self._report_queue()

    async def ready(self) -> dict:
        await self.engine.check_health()
        return {"deployment": self.deployment, "replica": self.replica_id, "model": self.model}

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
