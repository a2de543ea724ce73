"""PyTorch's CUDA allocator setting that vLLM refuses beside a KV connector, caught before vLLM is.

vLLM (0.26 and 0.32 alike) rejects any KV connector when ``PYTORCH_CUDA_ALLOC_CONF`` contains
``expandable_segments:True`` and the cumem allocator is off: the expandable allocator may remap
the KV cache's pages after NIXL registered them. vLLM says so from deep inside its config
checks, in the engine core, after the model is loaded; :func:`check` says it before the
engine starts, naming the variable and the way out.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefillshare.app.errors import PrefillShareLibraryError

__all__ = ["ALLOC_CONF", "ExpandableSegmentsError", "check"]

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


class ExpandableSegmentsError(PrefillShareLibraryError, ValueError):
    """An engine with a KV connector would start with PyTorch's expandable segments on."""


def _expandable(value: str) -> bool:
    opts = dict(part.split(":", 1) for part in value.replace(" ", "").split(",") if ":" in part)
    return opts.get("expandable_segments", "").lower() == "true"


def check(env: Mapping[str, str], kv_transfer_config: dict[str, Any] | None,
          engine_kwargs: Mapping[str, Any] | None = None, where: str = "engine") -> None:
    """Raise :class:`ExpandableSegmentsError` when an engine with ``kv_transfer_config`` would run
    under ``env`` with ``expandable_segments:True`` and without vLLM's cumem allocator."""
    if not kv_transfer_config or not _expandable(env.get(ALLOC_CONF, "")):
        return
    if (engine_kwargs or {}).get("enable_cumem_allocator"):
        return
    raise ExpandableSegmentsError(
        f"{where}: {ALLOC_CONF}={env[ALLOC_CONF]!r} turns on expandable_segments, which vLLM refuses beside the KV "
        f"connector {kv_transfer_config.get('kv_connector')} (the allocator may move KV pages NIXL registered): "
        f"remove expandable_segments:True from {ALLOC_CONF} (engine_env, a placement's env or the pod's env)")
