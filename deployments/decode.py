"""DecodeServer: one deployment per task decoder, streaming generation.

Each replica runs a vLLM engine on the decoder with the PrefillShare connector as consumer:
for a prompt whose base KV a prefill replica published, the engine loads it and computes only
the last prompt token itself. Decoders without a compatible prefill module run without a
connector and prefill privately. A replica that lands on a prefill node (one offering the
KV block server's resources) reads the producers' pool there, not ``pool.decode_path``.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray import serve

from app.engine.async_engine import EngineConfig, EngineRequestError
from deployments.engine_host import EngineHost
from deployments.errors import ErrorCode, Failure
from deployments.messages import DecodeChunk, DecodeRequest


@dataclass(frozen=True)
class PrefillNodeEngine:
    """The engine config for a replica on a node offering every one of ``resources``: its
    connector reads the producers' pool (``pool.path``) there. Only needed where prefill and
    decode "nodes" share one /dev/shm and decoders elsewhere use ``pool.decode_path``."""

    resources: dict[str, float]
    engine_config: EngineConfig


def node_offers(resources: dict[str, float]) -> bool:
    """Whether this process's Ray node advertises every resource named in ``resources``."""
    me = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == me), None)
    return node is not None and all(k in node["Resources"] for k in resources)


@serve.deployment(name="Decode")
class DecodeServer(EngineHost):
    async def __init__(self, model_name: str, engine_config: EngineConfig, metrics=None,
                       on_prefill_node: PrefillNodeEngine | None = None):
        self.model = model_name
        if on_prefill_node is not None and node_offers(on_prefill_node.resources):
            engine_config = on_prefill_node.engine_config
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

    async def _stream(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()
        ttft = None
        async for out in self.engine.generate(list(req.prompt_token_ids), req.sampling, req.request_id,
                                              cache_salt=req.cache_salt, lora=req.adapter):
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
