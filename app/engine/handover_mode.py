"""Hand-over modes: which vLLM KV connector carries a base's prompt KV to its decoders.

The one place a mode picks its connector class and builds vLLM's ``kv_transfer_config``.
``prefillshare``: this project's connector (:mod:`app.engine.connector`) over the node's KV
pool, or that pool filled through NIXL (:mod:`app.engine.kv_store`). The app's other mode,
``handover: vllm-nixl`` (vLLM's own NixlConnector), builds its config in
:func:`app.engine.vllm_nixl.nixl_transfer_config`; ``deployments/application.py`` picks the mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["HandoverMode", "MODES", "PREFILLSHARE", "kv_transfer_config"]


@dataclass(frozen=True)
class HandoverMode:
    """A connector vLLM loads by name (and module path, for one outside vLLM)."""

    name: str
    connector: str
    module_path: str | None
    # what vLLM does with a request whose KV failed to load; "recompute": a private prefill
    load_failure_policy: str = "recompute"

    def transfer_config(self, role: Literal["producer", "consumer"], extra: dict[str, Any]) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "kv_connector": self.connector,
            "kv_role": "kv_producer" if role == "producer" else "kv_consumer",
            "kv_connector_extra_config": extra,
            "kv_load_failure_policy": self.load_failure_policy,
        }
        if self.module_path:
            cfg["kv_connector_module_path"] = self.module_path
        return cfg


PREFILLSHARE = HandoverMode("prefillshare", "PrefillShareConnector", "app.engine.connector")
MODES: dict[str, HandoverMode] = {PREFILLSHARE.name: PREFILLSHARE}


def kv_transfer_config(mode: str, role: Literal["producer", "consumer"], extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for one engine of hand-over mode ``mode``."""
    try:
        return MODES[mode].transfer_config(role, extra)
    except KeyError:
        raise ValueError(f"hand-over mode {mode!r} is not one of {sorted(MODES)}") from None
