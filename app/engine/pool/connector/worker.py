"""The connector's worker half: moves bytes between the engine's paged KV cache and the store.

Producer (:meth:`ShareWorker.wait_for_save`, once every layer of the step is written): one
``reserve`` names the slots, one batched gather per layer fills them
(:mod:`prefillshare.app.engine.cpu_layout`), then ``publish`` makes them readable. Consumer
(:meth:`ShareWorker.start_load_kv`): copies each leased run in with one batched scatter per
layer (the trailing partial block up to its last token), checks the slots' generations around
the copy, then releases the lease and consumes the fan-out pins in one transaction, all before
the step's forward pass (the bytes are on this node: a local copy, no network).

A load that fails (``fallback:reused`` / ``torn`` / ``damaged`` / ``layout`` / ``missing``)
reports every block of the request invalid: vLLM recomputes the prompt from token 0
(``kv_load_failure_policy="recompute"``), a clean private prefill.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from prefillshare.app.engine.cpu_layout import BlockLayout
from prefillshare.app.engine.pool.connector.metadata import ConnectorSettings, LoadSpec, PrefillShareMeta
from prefillshare.app.engine.pool.kv_pool import MISSING, BlockDamaged, KVPool, SlotReused, SlotTorn
from prefillshare.app.errors import PrefillShareLibraryError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

__all__ = ["ShareWorker"]


class LayoutMismatch(PrefillShareLibraryError, ValueError):
    """A stored block was written by an engine with another KV layout."""


def _fallback_kind(e: Exception) -> str:
    if isinstance(e, SlotTorn):
        return "torn"
    if isinstance(e, BlockDamaged):
        return "damaged"
    if isinstance(e, SlotReused):
        return "reused"
    return "layout" if isinstance(e, LayoutMismatch) else "missing"


class ShareWorker:
    """Worker-side state of one engine's connector (see the module doc)."""

    def __init__(self, settings: ConnectorSettings, store: KVPool, block_size: int,
                 kv_cache_config: KVCacheConfig | None, layout: str | None):
        self.settings = settings
        self.store = store
        self.block_size = block_size
        self.kv_cache_config = kv_cache_config
        self.planned_layout = layout
        self.layout: BlockLayout | None = None
        self._invalid: set[int] = set()
        self._pinned: set[tuple[int, int]] = set()  # slab mappings registered with CUDA

    @property
    def scope(self) -> str:
        return self.settings.scope

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.kv_cache_config is None:
            raise RuntimeError("PrefillShare connector: vLLM gave the worker no kv_cache_config")
        spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        layout = BlockLayout.from_caches(list(kv_caches.values()), self.block_size, spec.num_kv_heads,
                                         spec.head_size, getattr(self.kv_cache_config, "num_blocks", None))
        self.layout = layout
        if self.planned_layout and layout.layout != self.planned_layout:
            log.warning("PrefillShare: cache layout %s differs from planned %s", layout.layout, self.planned_layout)
        if self.settings.role == "consumer" and layout.device.type == "cpu":
            # The CPU cache is allocated lazily by the OS: without this, a decoder's first loads
            # into never-used blocks pay a page fault per 4 KiB (several times the copy itself).
            for c in layout.caches:
                c.zero_()

    # ------------------------------------------------------------------ consumer
    def start_load_kv(self, meta: PrefillShareMeta) -> None:
        if not meta.loads:
            return
        assert self.layout is not None, "KV caches were never registered"
        for spec in meta.loads:
            self._invalid.update(self._load_one(spec, self.layout))

    def _load_one(self, spec: LoadSpec, layout: BlockLayout) -> set[int]:
        """Copy a leased run in (seqlock-checked); one transaction ends it. Returns invalid block ids."""
        t0, c0 = time.perf_counter(), time.thread_time()
        entries, store = spec.entries, self.store
        try:
            if any(e.layout != layout.layout for e in entries):
                raise LayoutMismatch(f"{entries[0].layout} != {layout.layout}")
            if any(e.nbytes != layout.block_nbytes for e in entries):
                raise LayoutMismatch(f"slot of {entries[0].nbytes} bytes, blocks of {layout.block_nbytes}")
            store.check_entries(entries)
            store.verify(entries)
            layout.load_slots(self._slab_tensor(entries[0].slab), [e.slot for e in entries], spec.block_ids,
                              entries[-1].ntokens)
            store.check_entries(entries)  # the slots were not reused while we copied
        except (BlockDamaged, *MISSING, ValueError, RuntimeError) as e:
            kind = _fallback_kind(e)
            log.warning("PrefillShare: load for %s failed (%s: %s); prefilling privately", spec.req_id, kind, e)
            store.add(self.scope, {f"fallback:{kind}": 1, "load_failures": 1})
            if kind in ("torn", "damaged"):
                store.discard([x.key for x in entries])
            store.release(spec.lease)
            if spec.lease is None:
                store.flush()
            return set(spec.block_ids)
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        # load_cpu_seconds: this thread's CPU time (what the copy cost, apart from waiting for a core)
        store.add(self.scope, {"loads": 1, "loaded_blocks": len(entries), "load_tokens": sum(e.ntokens for e in entries),
                               "load_seconds": dt, "load_cpu_seconds": dc,
                               "bytes_moved": sum(e.nbytes for e in entries)})
        store.release(spec.lease, consumed=[e.key for e in entries])  # the one worker transaction
        return set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    # ------------------------------------------------------------------ producer
    def wait_for_save(self, meta: PrefillShareMeta) -> None:
        if not meta.saves:
            return
        assert self.layout is not None, "KV caches were never registered"
        layout = self.layout
        for spec in meta.saves:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                res = self.store.reserve(spec.keys, layout.block_nbytes, spec.ntokens, layout.layout,
                                         pins=spec.pins, scope=self.scope)  # the one producer transaction
                new = [(e, bid) for e, bid in zip(res.entries, spec.block_ids, strict=True) if e is not None]
                if new:
                    layout.save_slots([bid for _, bid in new], self._slab_tensor(new[0][0].slab),
                                      [e.slot for e, _ in new])
                self.store.publish(res)
                self.store.add(self.scope, {"saves": 1, "save_seconds": time.perf_counter() - t0,
                                            "save_cpu_seconds": time.thread_time() - c0,
                                            "save_bytes": len(new) * layout.block_nbytes,
                                            "save_dropped": len(res.stored) - sum(res.stored)})
            except Exception as e:  # noqa: BLE001 - a failed save only means later misses
                log.warning("PrefillShare: save of %s failed: %s", spec.req_id, e)
                self.store.add(self.scope, {"save_failures": 1})
        self.store.flush_soon()

    def _slab_tensor(self, slot_bytes: int) -> torch.Tensor:
        """The slab as a tensor; with the cache on a GPU, page-locked once (cudaHostRegister, as vLLM's
        CPU offloading does) so that each request's one host<->device copy runs at DMA speed."""
        t = self.store.slab(slot_bytes).tensor()
        if self.layout is not None and self.layout.device.type == "cuda":
            key = (t.data_ptr(), t.numel())
            if key not in self._pinned:
                self._pinned.add(key)
                err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
                if int(err) != 0:
                    log.warning("PrefillShare: cudaHostRegister of the slab failed (%s); pageable copies", err)
        return t

    def shutdown(self) -> None:
        self.store.close()
