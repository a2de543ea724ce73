"""vLLM's NixlConnector, its side channel guarded by the KV secret, its progress thread optional.

Guard (always): :func:`app.engine.side_channel_auth.install` before vLLM opens its handshake
listener: CURVE with keys derived from ``PREFILLSHARE_KV_SECRET`` when the secret is set; without
one, an engine whose side channel is not on loopback refuses to start.

Progress thread (``progress_thread: false``):
vLLM creates its NIXL agent with the progress thread on and no delay between polls
(``nixl_agent_config(num_threads=..., capture_telemetry=True)``, ``pthrDelay=0``): that thread
spins whenever the agent exists. Measured here (docs/engine.md, "vLLM NixlConnector hand-over on
the CPU"): an idle agent burns about one core with it, nothing without it. A connector engine does
not need it: the connector already drives UCX from its own calls every engine step (it polls
transfer states and notifications in ``get_finished``), and a prefill engine keeps stepping while
it holds blocks for a decoder (vLLM counts those requests as unfinished work).

This class is vLLM's ``NixlConnector`` itself; only its side channel differs, and the agent it
creates when ``kv_connector_extra_config.progress_thread`` is false. It keeps vLLM's class name so that vLLM's
own checks for "NixlConnector" still apply to it; vLLM loads it from this module
(``kv_connector_module_path``).
"""
from __future__ import annotations

import functools

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector as _VllmNixlConnector

from app.engine import side_channel_auth
from app.engine.cpu_layout import request_amx_tiles

__all__ = ["NixlConnector", "MODULE"]

MODULE = __name__


class NixlConnector(_VllmNixlConnector):
    """vLLM's pull-mode NixlConnector; its side channel behind the KV secret;
    ``progress_thread: false`` makes its NIXL agent without a progress thread."""

    def __init__(self, vllm_config, role, kv_cache_config):
        from vllm import envs

        side_channel_auth.install(envs.VLLM_NIXL_SIDE_CHANNEL_HOST)
        # a decoder's first forward is attention over pulled KV, as with the pool, where that died of
        # SIGILL (cpu_layout); this path's bf16 tests did not die without it here: a guard, not a fix
        request_amx_tiles()
        ktc = vllm_config.kv_transfer_config
        progress_thread = bool(ktc.get_from_extra_config("progress_thread", True))
        make_config = base_worker.nixl_agent_config
        if progress_thread or make_config is None:
            super().__init__(vllm_config, role, kv_cache_config)
            return
        # the worker half builds its agent config from this module global while it is constructed
        base_worker.nixl_agent_config = functools.partial(make_config, enable_prog_thread=False)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            base_worker.nixl_agent_config = make_config
