"""EngineHost: what every engine-running replica (prefill or decode) shares.

One vLLM engine per replica, the decoder stream (``generate``: a decode replica's requests, and a
prefill replica's in-engine LoRA decoders'), an in-flight count reported to the Metrics deployment (the
router's load signal and the queue gauge), the engine's own vllm:* metrics sent there too
(deployments/metrics.py), and the health probe Serve calls periodically: a dead engine core
marks the replica unhealthy, so Serve restarts it.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Iterator

import ray
from ray import serve

from prefillshare.app.engine.async_engine import Engine, EngineConfig, EngineRequestError
from prefillshare.app.engine.handover import Handover
from prefillshare.app.engine_load import EngineLoadMeter
from prefillshare.deployments.errors import ErrorCode, Failure
from prefillshare.deployments.messages import DecodeChunk, DecodeRequest
from prefillshare.deployments.metrics import ENGINE_PUSH_S, MetricsSender, engine_samples


class EngineHost:
    engine: Engine

    async def _start_engine(self, engine_config: EngineConfig, handover: Handover | None, metrics) -> None:
        """``handover``: the app's (None: an engine without a connector, a private decoder)."""
        self.handover = handover
        if handover is not None:
            engine_config = handover.on_node(engine_config, node_ip())
        self.engine = await Engine.start(engine_config)
        self.metrics = MetricsSender(metrics) if metrics is not None else None
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.deployment = ctx.deployment
        self.in_flight = 0
        self._load = EngineLoadMeter()
        self._node_state = handover.node_state() if handover is not None else None
        if metrics is not None:
            self._engine_metrics = asyncio.get_running_loop().create_task(self._push_engine_metrics())

    async def _push_engine_metrics(self) -> None:
        """vLLM's stat logger keeps this replica's vllm:* metrics, and the hand-over mode may keep
        state on its node (the KV pool, with the connector's counters); the Metrics deployment, on
        another node perhaps, exports both."""
        name = next(iter(self._identity().values()), self.deployment)
        host, metrics = socket.gethostname(), self.metrics
        extra = self.handover.engine_metrics if self.handover is not None else frozenset()
        while metrics is not None:
            with contextlib.suppress(Exception):  # a missed push only delays the next scrape's numbers
                metrics.send("engine", self.deployment, self.replica_id, engine_samples(name, extra=extra))
            if self._node_state is not None:
                with contextlib.suppress(Exception):  # not there yet (its producer is starting): next time
                    metrics.gauge("node_state", host, self._node_state.source, self._node_state.families())
            await asyncio.sleep(ENGINE_PUSH_S)

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        self.in_flight += 1
        self._report_queue()
        try:
            yield
        finally:
            self.in_flight -= 1
            self._report_queue()

    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.gauge("queue", self.deployment, self.replica_id, self.in_flight)

    def _identity(self) -> dict:
        return {}

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

    def _served_name(self, req: DecodeRequest) -> str:
        return req.adapter or next(iter(self._identity().values()), self.deployment)

    def _failed(self, req: DecodeRequest, code: ErrorCode, e: Exception) -> DecodeChunk:
        return DecodeChunk(req.request_id, self._served_name(req), "", [], True, "error", error=Failure(code, str(e)))

    async def _stream(self, req: DecodeRequest, kv_transfer_params: dict | None = None) -> AsyncIterator[DecodeChunk]:
        """The engine's outputs for ``req`` as chunks."""
        name = self._served_name(req)
        async for out in self.engine.generate(list(req.prompt_token_ids), req.sampling, req.request_id,
                                              cache_salt=req.cache_salt, lora=req.adapter,
                                              kv_transfer_params=kv_transfer_params):
            yield DecodeChunk(
                request_id=req.request_id, model=name, delta_text=out.new_text,
                delta_token_ids=list(out.new_token_ids), finished=out.finished,
                finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens, index=out.index, logprobs=out.new_logprobs, stop_reason=out.stop_reason,
                prompt_logprobs=out.prompt_logprobs,
            )

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What this replica's engine reports to Serve's autoscaler each ``metrics_interval_s``
        (app/engine_load.py SIGNALS; the project's policy reads them, Serve's default ignores them);
        also sent to the Metrics deployment, so /metrics shows what the decision read."""
        stats = self._load.sample(self.engine.queued_prompt_tokens)
        if self.metrics is not None:
            self.metrics.gauge("autoscaling_signals", self.deployment, self.replica_id, stats)
        return stats

    async def ready(self) -> dict:
        await self.engine.check_health()
        return {"deployment": self.deployment, "replica": self.replica_id, **self._identity()}

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def node_ip() -> str:
    """The address other nodes reach this node's engines at (vLLM's VLLM_HOST_IP when set)."""
    return os.environ.get("VLLM_HOST_IP") or ray.util.get_node_ip_address()
