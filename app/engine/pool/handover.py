"""Hand-over ``pool``: the node's shared-memory KV pool, through the project's vLLM connector.

The prefill engine's connector (producer) publishes every prompt token but the last to the
pool, pinned for one load (``fanout``); each decoder's connector (consumer) on the same node
finds the base's blocks by key and copies them in (:mod:`prefillshare.app.engine.pool.connector`).
Nothing travels in the request: the decoder's connector finds the KV itself.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from prefillshare.app.engine.handover import KV_ROLE, Handover, ModuleLink, Role
from prefillshare.app.engine.pool.kv_pool import PoolSpec
from prefillshare.app.engine.pool.metrics import PoolState

if TYPE_CHECKING:
    from prefillshare.app.config import AppConfig

__all__ = ["PoolHandover", "connector_config", "CONNECTOR_NAME", "CONNECTOR_MODULE"]

CONNECTOR_NAME = "PrefillShareConnector"
CONNECTOR_MODULE = "prefillshare.app.engine.pool.connector"


def connector_config(role: Role, prefill_module_id: str, pool: PoolSpec, *, scope: str | None = None,
                     adapter_keys: bool = False) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` that loads the project's connector over ``pool``.

    ``role``: "producer" on prefill engines (the base), "consumer" on decode engines.
    ``prefill_module_id``: the base's id (a decoder takes it from its manifest, never from its
    own model name). ``scope``: label under which the pool keeps this engine's counters.
    ``adapter_keys``: KV is per LoRA adapter (a prefill engine holding the decoders' own
    adapters): pool keys carry the request's adapter name, on the producer and its consumers alike.
    """
    if role not in KV_ROLE:
        raise ValueError(f"connector_config role: {role!r} is not 'producer' or 'consumer'")
    if not prefill_module_id:
        raise ValueError("connector_config prefill_module_id is required")
    if not isinstance(pool, PoolSpec):
        raise ValueError("connector_config pool must be a PoolSpec")
    extra: dict[str, Any] = {"role": role, "prefill_module_id": prefill_module_id, "pool": asdict(pool)}
    if scope:
        extra["scope"] = scope
    if adapter_keys:
        extra["adapter_keys"] = True
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": KV_ROLE[role],
        "kv_connector_extra_config": extra,
        # a block found damaged while loading is recomputed (a private prefill), never a failed request
        "kv_load_failure_policy": "recompute",
    }


@dataclass(frozen=True)
class PoolHandover(Handover):
    """The pool's hand-over: one pool per node, its spec shared by every engine of the app."""

    pool: PoolSpec

    @classmethod
    def from_config(cls, cfg: AppConfig) -> PoolHandover:
        """The node's pool as the connector takes it: producers write it, consumers on the same node read it."""
        p = cfg.pool
        return cls(PoolSpec(path=p.path, capacity_bytes=p.capacity_bytes, lease_timeout_s=p.lease_timeout_s,
                            check=p.check, persist=p.persist))

    def transfer_config(self, role: Role, link: ModuleLink, *, on_gpu: bool = False) -> dict[str, Any]:
        return connector_config(role, link.module_id, self.pool, scope=link.scope, adapter_keys=link.adapter_keys)

    def node_state(self) -> PoolState:
        return PoolState(self.pool.path)

    def prefill_params(self) -> dict[str, Any]:
        # one decoder loads each prompt's blocks: pinned in the pool for one load
        return {"fanout": 1}
