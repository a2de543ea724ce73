"""The KV block server of a prefill node, as a Serve application of its own.

With ``pool.transport: nixl`` decoders on other nodes pull the prompt KV that the prefill
engines wrote into their node's pool: :class:`app.engine.nixl_transport.NixlBlockServer`
answers on ``pool.nixl_listen`` (control over TCP, bytes over NIXL straight out of the node's
slab). This deployment runs that
server on the prefill node (``pool.server_resources`` pins it there, the same custom
resources the prefill group's bundles ask for). It is a separate application because nothing
calls it through Serve: decoders reach it by address (``pool.nixl_peers``). Off loopback it
needs the cluster's KV secret (``PREFILLSHARE_KV_SECRET``, :mod:`app.engine.kv_auth`): peers
without it get nothing, and each refusal is counted (``nixl_auth_refused`` in the pool's
counters, exported on /metrics) and logged.
"""
from __future__ import annotations

from typing import Any

from ray import serve

from app.config import AppConfig, ConfigError, config_from_args
from app.engine.kv_pool import PoolSpec
from app.engine_args import pool_specs


@serve.deployment(name="KVBlockServer", num_replicas=1, max_ongoing_requests=8)
class KVBlockServer:
    def __init__(self, pool: PoolSpec, listen: str):
        from app.engine.nixl_transport import NixlBlockServer

        self.server = NixlBlockServer(pool, listen).start()

    def address(self) -> str:
        return self.server.address

    def stats(self) -> dict[str, Any]:
        """The served pool's counters (its fan-out loads include remote ones)."""
        st = self.server.pool.stats()
        return {"blocks": st.blocks, "bytes_held": st.bytes_held, "counters": dict(st.counters),
                "tickets_open": len(self.server.tickets), "auth_refused": self.server.refused}

    def check_health(self) -> None:
        if not self.server.thread.is_alive():
            raise RuntimeError("NIXL block server thread stopped")

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


def build_kv_server(cfg: AppConfig):
    """The block-server application for ``cfg`` (transport 'nixl' only)."""
    if cfg.pool.transport != "nixl":
        raise ConfigError("pool.transport: the KV block server is only needed with transport 'nixl'")
    opts: dict[str, Any] = {"num_cpus": 0.05}
    if cfg.pool.server_resources:
        # pinned by its resources, it asks no CPU: a prefill node may then offer Ray no CPU, which
        # keeps the ingress deployments (Serve spreads them over nodes with CPU) off that node
        opts = {"num_cpus": 0, "resources": dict(cfg.pool.server_resources)}
    return KVBlockServer.options(ray_actor_options=opts).bind(pool_specs(cfg.pool)[0], cfg.pool.nixl_listen)


def build_kv_app(args: dict[str, Any]):
    """Serve app builder (import path ``deployments.kv_server:build_kv_app``), same args as the main app."""
    return build_kv_server(config_from_args(args))
