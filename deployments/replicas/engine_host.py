"""EngineHost: what every engine-running replica (prefill or decode) shares.

One vLLM engine per replica, an in-flight count reported to the Metrics deployment (the
router's load signal and the queue gauge), the engine's own vllm:* metrics sent there too
(deployments/metrics.py), and the health probe Serve calls periodically: a dead engine core
marks the replica unhealthy, so Serve restarts it.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator

import ray
from ray import serve

from prefillshare.app.engine.async_engine import Engine, EngineConfig
from prefillshare.app.engine.handover import Handover
from prefillshare.deployments.metrics import ENGINE_PUSH_S, MetricsSender, PoolReader, engine_samples


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
        path = handover.pool_path if handover is not None else None
        self._pool = PoolReader(path) if path else None
        if metrics is not None:
            self._engine_metrics = asyncio.get_running_loop().create_task(self._push_engine_metrics())

    async def _push_engine_metrics(self) -> None:
        """vLLM's stat logger keeps this replica's vllm:* metrics, and its node's KV pool holds the
        connector's counters; the Metrics deployment, on another node perhaps, exports both."""
        name = next(iter(self._identity().values()), self.deployment)
        host = socket.gethostname()
        while True:
            with contextlib.suppress(Exception):  # a missed push only delays the next scrape's numbers
                self.metrics.send("engine", self.deployment, self.replica_id, engine_samples(name))
            if self._pool is not None:
                with contextlib.suppress(Exception):  # no pool yet (its producer is starting): next time
                    self.metrics.gauge("pool", host, self._pool.path, self._pool.families())
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
