"""What the connector's two halves share: its settings, and the per-step message from the
scheduler half to the worker half (vLLM carries it as the step's ``KVConnectorMetadata``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from prefillshare.app.engine.pool.kv_pool import BlockEntry, PoolSpec
from prefillshare.app.errors import PrefillShareLibraryError

__all__ = ["ConnectorConfigError", "ConnectorSettings", "LoadSpec", "SaveSpec", "PrefillShareMeta"]


class ConnectorConfigError(PrefillShareLibraryError, ValueError):
    """``kv_connector_extra_config`` is missing a field or holds a bad value."""


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's part of ``kv_transfer_config`` (built by
    :func:`prefillshare.app.engine.pool.handover.connector_config`), read once per engine process."""

    role: Literal["producer", "consumer"]
    module_id: str  # the prefill module whose KV is shared (a decoder's manifest names it)
    pool: PoolSpec
    scope: str  # label of this engine's counters in the pool
    adapter_keys: bool = False  # keys carry the request's LoRA adapter (per-adapter KV)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        for name in ("role", "prefill_module_id", "pool"):
            if name not in extra:
                raise ConnectorConfigError(f"PrefillShareConnector: kv_connector_extra_config.{name} is required")
        role = extra["role"]
        if role not in ("producer", "consumer"):
            raise ConnectorConfigError(f"PrefillShareConnector: role {role!r} is not producer/consumer")
        module_id = extra["prefill_module_id"]
        pool = extra["pool"]
        return cls(role, module_id, pool if isinstance(pool, PoolSpec) else PoolSpec(**pool),
                   extra.get("scope") or f"{role}:{module_id[:12]}", bool(extra.get("adapter_keys")))


@dataclass
class LoadSpec:
    """Consumer: copy these pool blocks into these engine blocks."""

    req_id: str
    entries: list[BlockEntry]
    block_ids: list[int]
    lease: str | None
    keys: list[str] = field(default_factory=list)
    ntokens_last: int = 0


@dataclass
class SaveSpec:
    """Producer: after the forward, copy these engine blocks to the pool under these keys."""

    req_id: str
    keys: list[str]
    ntokens: list[int]
    block_ids: list[int]
    pins: int


@dataclass
class PrefillShareMeta(KVConnectorMetadata):
    """One step's work for the worker half."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
