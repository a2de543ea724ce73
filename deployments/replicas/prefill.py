"""PrefillServer: the shared prefill group, one deployment per prefill module.

Each replica runs a vLLM engine on the frozen base with the app's hand-over
(app/engine/handover.py) as producer: each prompt's KV is kept for the one decoder that reads
it, and the ticket carries the hand-off that decoder needs, if any (vllm-nixl: a lease). For a fan-out the shared context is computed
first, so every agent prompt afterwards hits the prefix cache and only its own suffix is computed.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import ray
from ray import serve

from prefillshare.app.engine.async_engine import EngineConfig
from prefillshare.app.engine.handover import Handover
from prefillshare.app.prompt_split import shared_length
from prefillshare.deployments.messages import DecodeChunk, DecodeRequest, PrefillRecord, PrefillRequest, PrefillTicket
from prefillshare.deployments.replicas.engine_host import EngineHost


@serve.deployment(name="Prefill")
class PrefillServer(EngineHost):
    handover: Handover  # a prefill module always hands over

    # Ray Serve awaits an async constructor; the type checker knows only synchronous ones
    async def __init__(self, module_name: str, engine_config: EngineConfig, handover: Handover,  # type: ignore[misc]
                       metrics=None):
        self.module = module_name
        self.node_id = ray.get_runtime_context().get_node_id()
        await self._start_engine(engine_config, handover, metrics)

    def _identity(self) -> dict:
        return {"module": self.module}

    async def _stream(self, req: DecodeRequest, kv_transfer_params: dict | None = None) -> AsyncIterator[DecodeChunk]:
        """An in-engine LoRA decoder's stream: this module computed its shared KV, in this replica."""
        async for chunk in super()._stream(req, kv_transfer_params):
            chunk.prefill_module, chunk.prefill_replica = self.module, self.replica_id
            yield chunk

    async def prefill(self, req: PrefillRequest) -> PrefillTicket:
        """Compute each prompt's base KV; the producer connector publishes every prompt token
        but the last (the hand-over convention), pinned until that prompt's decoder loaded it."""
        with self._in_flight():
            return await self._prefill(req)

    async def _prefill(self, req: PrefillRequest) -> PrefillTicket:
        t0 = time.perf_counter()
        computed = cached = 0
        adapters = req.adapters or (None,) * len(req.prompts)
        # per-adapter prefill: the base's KV of the shared context is of no use to any adapter
        if len(req.shared_prefix) > 1 and not any(adapters):
            warm = await self.engine.prefill(list(req.shared_prefix), f"{req.request_id}-ctx",
                                             cache_salt=req.cache_salt)
            computed += warm.num_computed_tokens
            cached += warm.num_cached_tokens
        shared = [shared_length(len(p)) for p in req.prompts]  # tokens each decoder loads
        params = self.handover.prefill_params()  # one decoder reads each prompt's blocks
        sent = time.time()
        results = await asyncio.gather(*[
            self.engine.prefill(list(p), f"{req.request_id}-{i}", cache_salt=req.cache_salt,
                                kv_transfer_params=dict(params), lora=lora) if s else _nothing()
            for i, (p, s, lora) in enumerate(zip(req.prompts, shared, adapters))
        ])
        for r in results:
            if r is not None:
                computed += r.num_computed_tokens
                cached += r.num_cached_tokens
        handoffs = self.handover.handoffs(results, sent)
        seconds = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.send("prefill", PrefillRecord(self.module, self.replica_id, computed, cached, seconds,
                                                       sum(shared)))
        return PrefillTicket(
            prefill_module=self.module,
            replica_id=self.replica_id,
            num_computed_tokens=computed,
            node_id=self.node_id,
            handoffs=handoffs,
        )


async def _nothing() -> None:
    """A prompt with nothing to hand over (one token): no prefill."""
    return None

