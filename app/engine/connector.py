"""PrefillShareConnector: a vLLM KV connector through which decoders of other models use a base's KV.

Loaded by vLLM with ``kv_connector="PrefillShareConnector"``,
``kv_connector_module_path="app.engine.connector"``; build the config with
:func:`app.engine.async_engine.connector_config`.

Producer (prefill engine, the base): when a request's prefill completes (the step whose
scheduled tokens reach the end of the prompt, whatever the chunking), the worker copies every
block covering ``prompt[:-1]`` (hand-over convention, :mod:`app.handover`), including the
trailing partial block, into slots of the node's slab (:mod:`app.engine.kv_pool`) under
:mod:`app.engine.kv_keys` keys: one index transaction reserves the slots, one batched gather
per layer fills them, then they are published. ``kv_transfer_params={"fanout": N}`` pins
those blocks until N decoders loaded them.

Consumer (decode engine): ``get_num_new_matched_tokens`` looks up the keys of ``prompt[:-1]``
for the *configured prefill module id* and the request's ``cache_salt`` (tenant); it only
reads (vLLM may call it several times). Only a complete match is used (the decoder was
trained on base KV for every prompt token but the last). ``update_state_after_alloc`` leases
the run (one transaction); the worker copies it in with one batched scatter per layer (the
partial block up to its last token), checks the slots' generations around the copy, then
releases the lease and consumes the fan-out pins (one transaction). The decoder computes
exactly the last prompt token itself. With ``transport="nixl"`` a run not held on this node
is loaded asynchronously (``(n, True)``): a worker thread pulls it from a producer node
straight into this node's slab and into the cache, and reports completion through
``get_finished``; the scheduler never waits on the network.

Anything else is a private prefill, counted per scope: ``fallback:missing`` (never saved,
evicted, partly evicted, or a remote pull that failed), ``fallback:reused`` (a slot reused
after eviction while it was being loaded), ``fallback:torn`` (a slot whose writer did not
finish: producer died mid-save), ``fallback:damaged`` (crc32 mismatch, ``check="crc32"``
only), ``fallback:incompatible`` (config says the decoder may not share), ``fallback:layout``.
Failures found while loading report the request's blocks invalid and vLLM recomputes the
whole prompt (``kv_load_failure_policy="recompute"``).

Consumers should run without local prefix caching (``EngineConfig`` does this by default):
a locally cached block of a decoder may hold KV the decoder computed itself (after a fallback),
which would silently break the hand-over convention on a later request.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
from app.engine.kv_pool import (
    MISSING,
    BlockDamaged,
    BlockEntry,
    KVPool,
    PoolSpec,
    SlotReused,
    SlotTorn,
)
from app.handover import shared_length

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
    """Consumer: copy these pool blocks into these engine blocks (``remote``: pull ``keys`` first)."""

    req_id: str
    entries: list[BlockEntry]
    block_ids: list[int]
    lease: str | None
    keys: list[str] = field(default_factory=list)
    ntokens_last: int = 0
    remote: bool = False


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


@dataclass
class _Plan:
    """What ``get_num_new_matched_tokens`` found for a request (kept for the allocation that follows)."""

    computed: int
    tokens: int
    entries: list[BlockEntry]
    keys: list[str]
    ntokens_last: int
    remote: bool


def open_pool(spec: dict[str, Any] | PoolSpec) -> KVPool:
    """The pool (or the NIXL-backed pool) a connector's ``pool`` config names."""
    spec = spec if isinstance(spec, PoolSpec) else PoolSpec.from_dict(spec)
    if spec.transport == "nixl":  # NixlPool names a missing nixl_peers
        from app.engine.nixl_transport import NixlPool

        return NixlPool(spec)
    return KVPool(spec)


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
        self.remote = bool(getattr(self.pool, "peers", None)) and self.share_role == "consumer"
        self.layout_name = self._expected_layout(vllm_config, kv_cache_config)
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._keys: dict[str, list] = {}  # request -> its shared block keys (a memo)
        self._plans: dict[str, _Plan] = {}
        self._ready: dict[str, LoadSpec] = {}
        self._report: dict[str, dict[str, Any]] = {}
        self._blocks: dict[str, list[int]] = {}  # block ids per request, for vLLM without bind_kv_cache_manager
        self._loading: dict[str, tuple[set[int], bool]] = {}  # loads sent to the worker: block ids, remote
        self._pull_failed: set[str] = set()  # requests whose remote pull failed: prefill privately
        # worker side
        self._layout: BlockLayout | None = None
        self._invalid: set[int] = set()
        self._done_lock = threading.Lock()
        self._done: list[tuple[str, set[int]]] = []  # async loads finished: (request, invalid block ids)
        self._pulls: ThreadPoolExecutor | None = None
        self._pinned: set[tuple[int, int]] = set()  # slab mappings registered with CUDA

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
        """Reads the index only: vLLM may ask again for a request it could not place."""
        if self.share_role != "consumer":
            return 0, False
        rid = request.request_id
        self._plans.pop(rid, None)
        n = request.num_prompt_tokens
        shared = shared_length(n)
        if shared <= num_computed_tokens or shared <= 0:
            return 0, False
        if self.incompatible:
            self._note_fallback(rid, "incompatible", self.incompatible)
            return 0, False
        keys = self._keys.get(rid)
        if keys is None:
            keys = self._keys[rid] = shared_block_keys(self.module_id, self._salt(request),
                                                       list(request.prompt_token_ids or []), self.block_size)
        first = num_computed_tokens // self.block_size  # local hits are block-aligned here
        entries = self.pool.find([k.key for k in keys])
        if len(entries) < len(keys):
            if rid in self._pull_failed:  # vLLM asks again after a failed load: recompute, no second pull
                self._report[rid] = {"loaded_tokens": 0, "fallback": "missing", "counted": True}
                return 0, False
            if self.remote:  # pulled by a worker thread, asynchronously
                self._plans[rid] = _Plan(num_computed_tokens, shared - num_computed_tokens, [],
                                         [k.key for k in keys[first:]], keys[-1].num_tokens, True)
                self._report[rid] = {"loaded_tokens": shared - num_computed_tokens, "fallback": None}
                return shared - num_computed_tokens, True
            self._note_fallback(rid, "missing", f"{len(entries)}/{len(keys)} blocks in the pool")
            return 0, False
        if self.layout_name and any(e.layout != self.layout_name for e in entries):
            self._note_fallback(rid, "layout", f"{entries[0].layout} != {self.layout_name}")
            return 0, False
        self._plans[rid] = _Plan(num_computed_tokens, shared - num_computed_tokens, entries[first:],
                                 [k.key for k in keys[first:]], keys[-1].num_tokens, False)
        self._report[rid] = {"loaded_tokens": shared - num_computed_tokens, "fallback": None}
        return shared - num_computed_tokens, False

    def _note_fallback(self, rid: str, kind: str, detail: str) -> None:
        """Remembered per request; counted once, when the request finishes."""
        if (self._report.get(rid) or {}).get("fallback") != kind:
            log.info("PrefillShare: request %s prefills privately (%s: %s)", rid, kind, detail)
        self._report[rid] = {"loaded_tokens": 0, "fallback": kind, "detail": detail}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        rid = request.request_id
        plan = self._plans.pop(rid, None)
        if plan is None:
            return
        if num_external_tokens <= 0:
            self._report.pop(rid, None)
            return
        first = plan.computed // self.block_size
        block_ids = list(blocks.get_block_ids()[0])  # every block of the request, as the scheduler holds them
        ids = block_ids[first : first + len(plan.keys)]
        lease = None
        if not plan.remote:  # a remote pull counts its hit once it succeeded (worker)
            self.pool.add(self.scope, {"hits": 1, "hit_tokens": num_external_tokens})
            lease = self.pool.lease(plan.entries)  # the one scheduler transaction
        self._ready[rid] = LoadSpec(rid, plan.entries, ids, lease, plan.keys, plan.ntokens_last, plan.remote)

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
        for spec in meta.loads:
            self._loading[spec.req_id] = (set(spec.block_ids), spec.remote)
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

    def _salt(self, request: Request) -> str | None:
        lora = request.lora_request
        if not self.adapter_keys or lora is None:
            return request.cache_salt
        return f"{request.cache_salt or ''}|lora:{lora.lora_name}"

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
        self._report[req.request_id] = {"prefill_module_id": self.module_id, "shared_tokens": shared_length(req.num_prompt_tokens),
                                        "blocks": len(keys), "last_key": keys[-1].key if keys else None}
        return SaveSpec(req.request_id, [k.key for k in keys], [k.num_tokens for k in keys],
                        list(block_ids[: len(keys)]), pins)

    def update_connector_output(self, connector_output) -> None:
        """A load that failed in the worker: the request's report says so (the worker counted it)."""
        if not self._loading:
            return
        invalid = set(connector_output.invalid_block_ids or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        done = set(connector_output.finished_recving or ())
        for rid, (ids, remote) in list(self._loading.items()):
            if remote and rid not in done:
                continue
            del self._loading[rid]
            if ids & invalid or rid in failed:
                if remote:
                    self._pull_failed.add(rid)
                if rid in self._report:
                    self._report[rid] = {"loaded_tokens": 0, "fallback": "missing" if remote else "load_failed",
                                         "counted": True}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._blocks.pop(rid, None)
        self._keys.pop(rid, None)
        self._plans.pop(rid, None)
        self._loading.pop(rid, None)
        self._pull_failed.discard(rid)
        ready = self._ready.pop(rid, None)
        if ready is not None and ready.lease is not None:  # finished before its load was sent
            self.pool.release(ready.lease)
        report = self._report.pop(rid, None)
        if report and report.pop("counted", False):
            pass
        elif report and report.get("fallback"):
            self.pool.add(self.scope, {"misses": 1, f"fallback:{report['fallback']}": 1})
        self.pool.flush()  # a request that loaded nothing: its one transaction (none when nothing is pending)
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
        if self.share_role == "consumer" and self._layout.device.type == "cpu":
            # The CPU cache is allocated lazily by the OS: without this, a decoder's first loads
            # into never-used blocks pay a page fault per 4 KiB (several times the copy itself).
            for c in self._layout.caches:
                c.zero_()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PrefillShareMeta) or not meta.loads:
            return
        assert self._layout is not None, "KV caches were never registered"
        for spec in meta.loads:
            if spec.remote:
                if self._pulls is None:
                    self._pulls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prefillshare-pull")
                self._pulls.submit(self._load_remote, spec)
            else:
                self._invalid.update(self._load_one(spec))

    def _load_remote(self, spec: LoadSpec) -> None:
        """Worker thread: pull the run from a producer node into this node's slab, then load it."""
        try:
            entries, lease = self.pool.fetch(spec.keys)
        except Exception as e:  # noqa: BLE001 - a failed pull is a private prefill, never a crash
            log.warning("PrefillShare: pull for %s failed: %s", spec.req_id, e)
            entries, lease = [], None
        if len(entries) < len(spec.keys):
            self.pool.add(self.scope, {"fallback:missing": 1, "misses": 1, "load_failures": 1})
            self.pool.release(lease)
            self.pool.flush()
            bad = set(spec.block_ids)
        else:
            self.pool.add(self.scope, {"hits": 1, "hit_tokens": sum(e.ntokens for e in entries)})
            bad = self._load_one(LoadSpec(spec.req_id, entries, spec.block_ids, lease, spec.keys, spec.ntokens_last))
        with self._done_lock:
            self._done.append((spec.req_id, bad))

    def _take_done(self) -> list[tuple[str, set[int]]]:
        with self._done_lock:
            done, self._done = self._done, []
        return done

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads done (vLLM without ``get_transfer_results``: failures as invalid blocks)."""
        done = self._take_done()
        for _, bad in done:
            self._invalid.update(bad)
        return None, ({rid for rid, _ in done} or None)

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Async loads done; failed ones named as such (vLLM then recomputes them from token 0)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        done = self._take_done()
        return KVConnectorTransferResults(finished_recving={rid for rid, _ in done},
                                          failed_recving={rid for rid, bad in done if bad})

    def _load_one(self, spec: LoadSpec) -> set[int]:
        """Copy a leased run in (seqlock-checked); one transaction ends it. Returns invalid block ids."""
        t0, c0 = time.perf_counter(), time.thread_time()
        layout = self._layout
        entries = spec.entries
        try:
            if any(e.layout != layout.layout for e in entries):
                raise _LayoutMismatch(f"{entries[0].layout} != {layout.layout}")
            if any(e.nbytes != layout.block_nbytes for e in entries):
                raise _LayoutMismatch(f"slot of {entries[0].nbytes} bytes, blocks of {layout.block_nbytes}")
            self.pool.check_entries(entries)
            self.pool.verify(entries)
            layout.load_slots(self._slab_tensor(entries[0].slab), [e.slot for e in entries], spec.block_ids,
                              entries[-1].ntokens)
            self.pool.check_entries(entries)  # the slots were not reused while we copied
        except (BlockDamaged, *MISSING, ValueError, RuntimeError) as e:
            kind = ("torn" if isinstance(e, SlotTorn) else "damaged" if isinstance(e, BlockDamaged) else
                    "reused" if isinstance(e, SlotReused) else
                    "layout" if isinstance(e, _LayoutMismatch) else "missing")
            log.warning("PrefillShare: load for %s failed (%s: %s); prefilling privately", spec.req_id, kind, e)
            # Every block of the request is reported: vLLM recomputes the prompt from token 0,
            # a clean private prefill rather than a mix of base and decoder KV.
            self.pool.add(self.scope, {f"fallback:{kind}": 1, "load_failures": 1})
            if kind in ("torn", "damaged"):
                self.pool.discard([x.key for x in entries])
            self.pool.release(spec.lease)
            if spec.lease is None:
                self.pool.flush()
            return set(spec.block_ids)
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        tokens = sum(e.ntokens for e in entries)
        # load_cpu_seconds: this thread's CPU time (what the copy cost, apart from waiting for a core)
        self.pool.add(self.scope, {"loads": 1, "loaded_blocks": len(entries), "load_tokens": tokens,
                                   "load_seconds": dt, "load_cpu_seconds": dc,
                                   "bytes_moved": sum(e.nbytes for e in entries)})
        self.pool.release(spec.lease, consumed=[e.key for e in entries])  # the one worker transaction
        return set()

    def _slab_tensor(self, slot_bytes: int) -> torch.Tensor:
        """The slab as a tensor; with the cache on a GPU, page-locked once (cudaHostRegister, as vLLM's
        CPU offloading does) so that each request's one host<->device copy runs at DMA speed."""
        t = self.pool.slab(slot_bytes).tensor()
        if self._layout is not None and self._layout.device.type == "cuda":
            key = (t.data_ptr(), t.numel())
            if key not in self._pinned:
                self._pinned.add(key)
                err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
                if int(err) != 0:
                    log.warning("PrefillShare: cudaHostRegister of the slab failed (%s); pageable copies", err)
        return t

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # device-local loads complete in start_load_kv; remote ones report through get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once every layer of the step is written

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, PrefillShareMeta) or not meta.saves:
            return
        assert self._layout is not None, "KV caches were never registered"
        layout = self._layout
        for spec in meta.saves:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                res = self.pool.reserve(spec.keys, layout.block_nbytes, spec.ntokens, layout.layout,
                                        pins=spec.pins, scope=self.scope)  # the one producer transaction
                new = [(e, bid) for e, bid in zip(res.entries, spec.block_ids, strict=True) if e is not None]
                if new:
                    layout.save_slots([bid for _, bid in new], self._slab_tensor(new[0][0].slab),
                                      [e.slot for e, _ in new])
                self.pool.publish(res)
                self.pool.add(self.scope, {"saves": 1, "save_seconds": time.perf_counter() - t0,
                                           "save_cpu_seconds": time.thread_time() - c0,
                                                 "save_bytes": len(new) * layout.block_nbytes,
                                                 "save_dropped": len(res.stored) - sum(res.stored)})
            except Exception as e:  # noqa: BLE001 - a failed save only means later misses
                log.warning("PrefillShare: save of %s failed: %s", spec.req_id, e)
                self.pool.add(self.scope, {"save_failures": 1})
        self.pool.flush_soon()

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def shutdown(self):
        if self._pulls is not None:
            self._pulls.shutdown(wait=False, cancel_futures=True)
        self.pool.flush()
