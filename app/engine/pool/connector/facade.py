"""The class vLLM loads: a thin ``KVConnectorBase_V1`` that hands each call to its half.

vLLM builds one connector per role: in the scheduler (``KVConnectorRole.SCHEDULER``) and in
each worker (``KVConnectorRole.WORKER``). Each builds only its own half
(:class:`~prefillshare.app.engine.pool.connector.scheduler.ShareScheduler` or
:class:`~prefillshare.app.engine.pool.connector.worker.ShareWorker`) over the node's KV pool the settings name
(:class:`prefillshare.app.engine.pool.kv_pool.KVPool`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from prefillshare.app.engine.cpu_layout import fingerprint, request_amx_tiles
from prefillshare.app.engine.pool.connector.metadata import ConnectorSettings, PrefillShareMeta
from prefillshare.app.engine.pool.connector.scheduler import ShareScheduler
from prefillshare.app.engine.pool.connector.worker import ShareWorker
from prefillshare.app.engine.pool.kv_pool import KVPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["PrefillShareConnector", "planned_layout"]


def planned_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    """The KV layout name the engine will have, where it is known before the caches exist (CPU)."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return None
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    dev = vllm_config.device_config.device_type
    if dev != "cpu":
        return None  # other devices: the worker names the layout once it sees the cache tensors
    return fingerprint(dev, spec.dtype, len(group.layer_names), spec.num_kv_heads, spec.head_size, spec.block_size)


class PrefillShareConnector(KVConnectorBase_V1):
    """Producer on the base's engine, consumer on decoders' engines (:mod:`prefillshare.app.engine.pool.connector`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.settings = settings
        block_size = vllm_config.cache_config.block_size
        layout = planned_layout(vllm_config, kv_cache_config)
        self.scheduler: ShareScheduler | None = None
        self.worker: ShareWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = ShareScheduler(settings, KVPool(settings.pool), block_size, layout)
        else:
            request_amx_tiles()
            self.worker = ShareWorker(settings, KVPool(settings.pool), block_size, kv_cache_config, layout)

    @property
    def _scheduler(self) -> ShareScheduler:
        """The scheduler half; vLLM calls scheduler-side methods only on the SCHEDULER role's instance."""
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side call reached the worker's connector")
        return self.scheduler

    @property
    def _worker(self) -> ShareWorker:
        """The worker half; vLLM calls worker-side methods only on the WORKER role's instance."""
        if self.worker is None:
            raise RuntimeError("a worker-side call reached the scheduler's connector")
        return self.worker

    def _meta(self) -> PrefillShareMeta:
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, PrefillShareMeta) else PrefillShareMeta()

    # ------------------------------------------------------------------ scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.block_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler.request_finished(request)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once every layer of the step is written

    def wait_for_save(self):
        self._worker.wait_for_save(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self):
        for half in (self.scheduler, self.worker):
            if half is not None:
                half.shutdown()
