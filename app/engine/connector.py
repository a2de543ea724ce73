"""PrefillShareConnector: a vLLM KV connector through which decoders of other models use a base's KV.

Loaded by vLLM with ``kv_connector="PrefillShareConnector"``,
``kv_connector_module_path="app.engine.connector"``; build the config with
:func:`app.engine.async_engine.connector_config`.

Producer (prefill engine, the base): when a request's prefill completes (the step whose
scheduled tokens reach the end of the prompt, whatever the chunking), the worker copies every
block covering ``prompt[:-1]`` (hand-over convention, :mod:`app.handover`), including the
trailing partial block, into the pool under :mod:`app.engine.kv_keys` keys. The request's
``kv_transfer_params={"fanout": N}`` pins those blocks until N decoders loaded them.

Consumer (decode engine): ``get_num_new_matched_tokens`` looks up the keys of ``prompt[:-1]``
for the *configured prefill module id* and the request's ``cache_salt`` (tenant). Only a
complete match is used (the decoder was trained on base KV for every prompt token but the
last); the worker then copies the blocks in, the partial one token by token, and the decoder
computes exactly the last prompt token itself. Anything else is a private prefill, counted:
``fallback:missing`` (never saved, evicted, partly evicted), ``fallback:damaged`` (checksum;
found while loading: the blocks are reported invalid and vLLM recomputes the whole prompt),
``fallback:incompatible`` (config says the decoder may not share), ``fallback:layout``.

Consumers should run without local prefix caching (``EngineConfig`` does this by default):
a locally cached block of a decoder may hold KV the decoder computed itself (after a fallback),
which would silently break the hand-over convention on a later request.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from app.engine.cpu_layout import BlockLayout, fingerprint
from app.engine.kv_keys import shared_block_keys
from app.engine.kv_pool import BlockDamaged, BlockEntry, BlockMissing, KVPool, PutItem

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["PrefillShareConnector", "PrefillShareMeta", "LoadSpec", "SaveSpec", "open_pool"]


class _LayoutMismatch(ValueError):
    """A stored block was written by an engine with another KV layout."""


@dataclass
class LoadSpec:
    """Consumer: copy these pool blocks into these engine blocks before the forward."""

    req_id: str
    entries: list[BlockEntry]
    block_ids: list[int]
    lease: str | None


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
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def open_pool(spec: dict[str, Any]) -> KVPool:
    """The pool (or the NIXL-backed pool) a connector's ``pool`` config names."""
    if spec.get("transport", "shm") == "nixl":
        from app.engine.nixl_transport import NixlPool

        return NixlPool(spec)
    return KVPool(spec["path"], spec.get("capacity_bytes", 1 << 30), spec.get("lease_timeout_s", 60.0))


class PrefillShareConnector(KVConnectorBase_V1):
    """Producer on the base's engine, consumer on decoders' engines; see the module doc."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        for name in ("role", "prefill_module_id", "pool"):
            if name not in extra:
                raise ValueError(f"PrefillShareConnector: kv_connector_extra_config.{name} is required")
        if extra["role"] not in ("producer", "consumer"):
            raise ValueError(f"PrefillShareConnector: role {extra['role']!r} is not producer/consumer")
        self.share_role: str = extra["role"]
        self.module_id: str = extra["prefill_module_id"]
        self.incompatible: str | None = extra.get("incompatible_reason")
        self.scope: str = extra.get("scope") or f"{self.share_role}:{self.module_id[:12]}"
        # per-adapter KV (a prefill engine holding the decoders' own LoRA adapters): keys carry the
        # adapter's name, so one adapter never loads KV another computed
        self.adapter_keys: bool = bool(extra.get("adapter_keys"))
        self.block_size: int = vllm_config.cache_config.block_size
        self.pool = open_pool(extra["pool"])
        self.layout_name = self._expected_layout(vllm_config, kv_cache_config)
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._plans: dict[str, tuple[list[BlockEntry], str | None, int]] = {}
        self._ready: dict[str, LoadSpec] = {}
        self._report: dict[str, dict[str, Any]] = {}
        self._blocks: dict[str, list[int]] = {}  # block ids per request, for vLLM without bind_kv_cache_manager
        # worker side
        self._layout: BlockLayout | None = None
        self._invalid: set[int] = set()

    @staticmethod
    def _expected_layout(vllm_config, kv_cache_config) -> str | None:
        if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
            return None
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        dev = vllm_config.device_config.device_type
        if dev != "cpu":
            return None  # other devices: the worker names the layout once it sees the cache tensors
        return fingerprint(dev, spec.dtype, len(group.layer_names), spec.num_kv_heads, spec.head_size,
                           spec.block_size)

    # ================================ scheduler side ======================================
    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.share_role != "consumer":
            return 0, False
        rid = request.request_id
        old = self._plans.pop(rid, None)
        if old is not None:  # asked again (request was not scheduled last time): fresh lease
            self.pool.release(old[1])
        n = request.num_prompt_tokens
        shared = n - 1
        if shared <= num_computed_tokens or shared <= 0:
            return 0, False
        if self.incompatible:
            self._fallback(rid, "incompatible", self.incompatible)
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        keys = shared_block_keys(self.module_id, self._salt(request), prompt, self.block_size)
        entries, lease = self.pool.lookup([k.key for k in keys])
        if len(entries) < len(keys):
            self.pool.release(lease)
            self._fallback(rid, "missing", f"{len(entries)}/{len(keys)} blocks in the pool")
            return 0, False
        if self.layout_name and any(e.layout != self.layout_name for e in entries):
            self.pool.release(lease)
            self._fallback(rid, "layout", f"{entries[0].layout} != {self.layout_name}")
            return 0, False
        first = num_computed_tokens // self.block_size  # local hits are block-aligned here
        self._plans[rid] = (entries[first:], lease, first)
        self._report[rid] = {"loaded_tokens": shared - num_computed_tokens, "fallback": None}
        return shared - num_computed_tokens, False

    def _salt(self, request: Request) -> str | None:
        lora = request.lora_request
        if not self.adapter_keys or lora is None:
            return request.cache_salt
        return f"{request.cache_salt or ''}|lora:{lora.lora_name}"

    def _fallback(self, rid: str, kind: str, detail: str) -> None:
        # The scheduler asks again for a request it could not place; count each request once.
        if (self._report.get(rid) or {}).get("fallback") != kind:
            self.pool.count_map(self.scope, {"misses": 1, f"fallback:{kind}": 1})
            log.info("PrefillShare: request %s prefills privately (%s: %s)", rid, kind, detail)
        self._report[rid] = {"loaded_tokens": 0, "fallback": kind, "detail": detail}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        rid = request.request_id
        plan = self._plans.pop(rid, None)
        if plan is None:
            return
        entries, lease, first = plan
        if num_external_tokens <= 0:
            self.pool.release(lease)
            self._report.pop(rid, None)
            return
        block_ids = blocks.get_block_ids()[0]  # every block of the request, as the scheduler holds them
        self._ready[rid] = LoadSpec(rid, entries, list(block_ids[first : first + len(entries)]), lease)
        self.pool.count(self.scope, hits=1, hit_tokens=num_external_tokens)

    def _block_ids(self, rid: str) -> list[int]:
        """The request's KV block ids (first cache group), for saving. vLLM >= 0.27 binds its block
        manager to the connector; older ones (vllm 0.26, the CUDA build that matches torch 2.11) do
        not, so the ids the scheduler announced are tracked in ``_blocks``."""
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is not None:
            return list(manager.get_block_ids(rid)[0])
        return self._blocks.get(rid, [])

    def _track_blocks(self, scheduler_output: SchedulerOutput) -> None:
        for r in scheduler_output.scheduled_new_reqs:
            self._blocks[r.req_id] = list(r.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new in zip(cached.req_ids, cached.new_block_ids):
            if rid in cached.resumed_req_ids:
                self._blocks[rid] = list(new[0]) if new else []
            elif new:
                self._blocks.setdefault(rid, []).extend(new[0])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PrefillShareMeta(loads=list(self._ready.values()))
        self._ready.clear()
        if getattr(self, "_kv_cache_manager", None) is None:
            self._track_blocks(scheduler_output)
        if self.share_role == "producer":
            steps: list[tuple[str, int]] = [(r.req_id, r.num_computed_tokens)
                                            for r in scheduler_output.scheduled_new_reqs]
            cached = scheduler_output.scheduled_cached_reqs
            steps += list(zip(cached.req_ids, cached.num_computed_tokens))
            for rid, before in steps:
                req = self._requests.get(rid)
                if req is None:
                    continue
                n = req.num_prompt_tokens
                after = before + scheduler_output.num_scheduled_tokens.get(rid, 0)
                if not (before < n <= after) or n < 2:
                    continue
                spec = self._save_spec(req)
                if spec is not None:
                    meta.saves.append(spec)
        return meta

    def _save_spec(self, req: Request) -> SaveSpec | None:
        keys = shared_block_keys(self.module_id, self._salt(req), list(req.prompt_token_ids or []), self.block_size)
        block_ids = self._block_ids(req.request_id)
        if len(block_ids) < len(keys):
            log.warning("PrefillShare: request %s has %d blocks for %d keys; not saved",
                        req.request_id, len(block_ids), len(keys))
            return None
        params = req.kv_transfer_params or {}
        try:
            pins = max(int(params.get("fanout", 0)), 0)
        except (TypeError, ValueError):
            pins = 0
        self._report[req.request_id] = {"prefill_module_id": self.module_id, "shared_tokens": req.num_prompt_tokens - 1,
                                        "blocks": len(keys), "last_key": keys[-1].key if keys else None}
        return SaveSpec(req.request_id, [k.key for k in keys], [k.num_tokens for k in keys],
                        list(block_ids[: len(keys)]), pins)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._blocks.pop(rid, None)
        plan = self._plans.pop(rid, None)
        if plan is not None:
            self.pool.release(plan[1])
        ready = self._ready.pop(rid, None)
        if ready is not None:
            self.pool.release(ready.lease)
        report = self._report.pop(rid, None)
        return False, ({"prefillshare": report} if report else None)

    # ================================== worker side =======================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self._layout = BlockLayout.from_caches(list(kv_caches.values()), self.block_size,
                                               spec.num_kv_heads, spec.head_size,
                                               getattr(self._kv_cache_config, "num_blocks", None))
        if self.layout_name and self._layout.layout != self.layout_name:
            log.warning("PrefillShare: cache layout %s differs from planned %s", self._layout.layout,
                        self.layout_name)
        self.layout_name = self._layout.layout

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PrefillShareMeta) or not meta.loads:
            return
        assert self._layout is not None, "KV caches were never registered"
        for spec in meta.loads:
            self._load_one(spec)

    def _load_one(self, spec: LoadSpec) -> None:
        t0 = time.perf_counter()
        moved = tokens = 0
        try:
            for entry, block_id in zip(spec.entries, spec.block_ids, strict=True):
                if entry.layout != self._layout.layout:
                    raise _LayoutMismatch(f"{entry.layout} != {self._layout.layout}")
                buf = self.pool.read(entry)
                self._layout.scatter(self._layout.view_bytes(buf), block_id, entry.ntokens)
                moved += entry.nbytes
                tokens += entry.ntokens
        except (BlockDamaged, BlockMissing, ValueError, RuntimeError) as e:
            kind = ("damaged" if isinstance(e, BlockDamaged) else
                    "layout" if isinstance(e, _LayoutMismatch) else "missing")
            log.warning("PrefillShare: load for %s failed (%s: %s); prefilling privately", spec.req_id, kind, e)
            # Every block of the request is reported: vLLM recomputes the prompt from token 0,
            # a clean private prefill rather than a mix of base and decoder KV.
            self._invalid.update(spec.block_ids)
            if isinstance(e, BlockDamaged):
                self.pool.discard([entry.key])
            self.pool.release(spec.lease)
            self.pool.count_map(self.scope, {f"fallback:{kind}": 1, "load_failures": 1})
            return
        dt = time.perf_counter() - t0
        self.pool.release(spec.lease, consumed=[e.key for e in spec.entries])
        self.pool.count_map(self.scope, {"loads": 1, "loaded_blocks": len(spec.entries), "load_tokens": tokens,
                                         "load_seconds": dt, "bytes_moved": moved})

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once every layer of the step is written

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, PrefillShareMeta) or not meta.saves:
            return
        assert self._layout is not None, "KV caches were never registered"
        for spec in meta.saves:
            t0 = time.perf_counter()
            try:
                items = []
                for depth, (key, nt, bid) in enumerate(zip(spec.keys, spec.ntokens, spec.block_ids, strict=True)):
                    blk = self._layout.gather(bid)
                    if blk.device.type != "cpu":
                        blk = blk.cpu()
                    items.append(PutItem(key, blk.view(torch.uint8).numpy(), nt, self._layout.layout, depth))
                ok = self.pool.put_many(items, pins=spec.pins, scope=self.scope)
                self.pool.count_map(self.scope, {"saves": 1, "save_seconds": time.perf_counter() - t0,
                                                 "save_dropped": len(ok) - sum(ok)})
            except Exception as e:  # noqa: BLE001 - a failed save only means later misses
                log.warning("PrefillShare: save of %s failed: %s", spec.req_id, e)
                self.pool.count_map(self.scope, {"save_failures": 1})

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out
