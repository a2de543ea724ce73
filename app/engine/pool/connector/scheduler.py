"""The connector's scheduler half: which prompt tokens a request takes from the store, and
which blocks a producer saves. It runs in vLLM's scheduler, reads the store's index and
touches it at most once per request per side; it never moves bytes (the worker half does).

Consumer: :meth:`ShareScheduler.get_num_new_matched_tokens` looks up the keys of ``prompt[:-1]``
(hand-over convention, :mod:`prefillshare.app.prompt_split`) for the configured prefill module id and the
request's salt; it only reads (vLLM may ask several times). Only a complete match counts;
:meth:`update_state_after_alloc` leases the run, and the next step's metadata tells the worker
to copy it in.

Producer: :meth:`build_connector_meta` names, for each request whose prefill completes in this
step (whatever the chunking), the blocks covering ``prompt[:-1]`` and their keys, with
``kv_transfer_params={"fanout": N}`` as N pins.

Every private prefill is remembered with its reason and counted once, in
:meth:`request_finished`, which also returns the request's report as ``kv_transfer_params``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefillshare.app.engine.pool.connector.metadata import ConnectorSettings, LoadSpec, PrefillShareMeta, SaveSpec
from prefillshare.app.engine.pool.kv_keys import BlockKey, key_salt, shared_block_keys
from prefillshare.app.engine.pool.kv_pool import BlockEntry, KVPool
from prefillshare.app.engine.vllm_plugin import handover_adapters
from prefillshare.app.prompt_split import shared_length

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["ShareScheduler"]


@dataclass
class _Plan:
    """What ``get_num_new_matched_tokens`` found for a request (kept for the allocation that follows)."""

    computed: int
    tokens: int
    entries: list[BlockEntry]
    keys: list[str]
    ntokens_last: int


class ShareScheduler:
    """Scheduler-side state of one engine's connector (see the module doc)."""

    def __init__(self, settings: ConnectorSettings, store: KVPool, block_size: int, layout: str | None):
        self.settings = settings
        self.store = store
        self.block_size = block_size
        self.layout = layout  # the engine's KV layout name, when known before the worker starts
        self.block_manager = None  # vLLM's KVCacheManager, where vLLM binds one (>= 0.27)
        self._requests: dict[str, Request] = {}
        self._keys: dict[str, list[BlockKey]] = {}  # request -> its shared block keys (a memo)
        self._plans: dict[str, _Plan] = {}
        self._ready: dict[str, LoadSpec] = {}
        self._report: dict[str, dict[str, Any]] = {}
        self._blocks: dict[str, list[int]] = {}  # block ids per request, for vLLM without a bound manager
        self._loading: dict[str, set[int]] = {}  # loads sent to the worker: their block ids

    def keys_of(self, request: Request) -> list[BlockKey]:
        """The keys of the request's shared prompt part (salted by tenant, and adapter if per-adapter)."""
        lora = request.lora_request
        adapter = lora.lora_name if self.settings.adapter_keys and lora is not None else None
        return shared_block_keys(self.settings.module_id, key_salt(request.cache_salt, adapter),
                                 list(request.prompt_token_ids or []), self.block_size)

    # ------------------------------------------------------------------ consumer
    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens the store gives, loaded asynchronously?); reads the index only."""
        if self.settings.role != "consumer":
            return 0, False
        rid = request.request_id
        self._plans.pop(rid, None)
        shared = shared_length(request.num_prompt_tokens)
        if shared <= num_computed_tokens or shared <= 0:
            return 0, False
        keys = self._keys.get(rid)
        if keys is None:
            keys = self._keys[rid] = self.keys_of(request)
        first = num_computed_tokens // self.block_size  # local hits are block-aligned here
        tokens = shared - num_computed_tokens
        names = [k.key for k in keys]
        entries = self.store.find(names)
        if len(entries) < len(keys):
            self._note_fallback(rid, "missing", f"{len(entries)}/{len(keys)} blocks in the pool")
            return 0, False
        if self.layout and any(e.layout != self.layout for e in entries):
            self._note_fallback(rid, "layout", f"{entries[0].layout} != {self.layout}")
            return 0, False
        self._plan(rid, _Plan(num_computed_tokens, tokens, entries[first:], names[first:], keys[-1].num_tokens))
        return tokens, False

    def _plan(self, rid: str, plan: _Plan) -> None:
        self._plans[rid] = plan
        self._report[rid] = {"loaded_tokens": plan.tokens, "fallback": None}

    def _note_fallback(self, rid: str, kind: str, detail: str) -> None:
        """Remembered per request; counted once, when the request finishes."""
        if (self._report.get(rid) or {}).get("fallback") != kind:
            log.info("PrefillShare: request %s prefills privately (%s: %s)", rid, kind, detail)
        self._report[rid] = {"loaded_tokens": 0, "fallback": kind, "detail": detail}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The scheduler placed the request: lease its run (the one scheduler transaction)."""
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
        self.store.add(self.settings.scope, {"hits": 1, "hit_tokens": num_external_tokens})
        lease = self.store.lease(plan.entries)
        self._ready[rid] = LoadSpec(rid, plan.entries, ids, lease, plan.keys, plan.ntokens_last)

    def update_connector_output(self, connector_output) -> None:
        """A load that failed in the worker: the request's report says so (the worker counted it)."""
        if not self._loading:
            return
        invalid = set(connector_output.invalid_block_ids or ())
        for rid, ids in list(self._loading.items()):
            del self._loading[rid]
            if ids & invalid and rid in self._report:
                self._report[rid] = {"loaded_tokens": 0, "fallback": "load_failed", "counted": True}

    # ------------------------------------------------------------------ both
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrefillShareMeta:
        """This step's loads (leased in ``update_state_after_alloc``) and, on a producer, saves."""
        meta = PrefillShareMeta(loads=list(self._ready.values()))
        self._ready.clear()
        for spec in meta.loads:
            self._loading[spec.req_id] = set(spec.block_ids)
        if self.block_manager is None:
            self.track_blocks(scheduler_output)
        if self.settings.role == "producer":
            meta.saves = self._saves(scheduler_output)
        return meta

    def _saves(self, scheduler_output: SchedulerOutput) -> list[SaveSpec]:
        """A save for each request whose prompt's last token is computed in this step."""
        steps: list[tuple[str, int]] = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += list(zip(cached.req_ids, cached.num_computed_tokens))
        saves = []
        for rid, before in steps:
            req = self._requests.get(rid)
            if req is None or (req.lora_request is not None and req.lora_request.lora_name in handover_adapters()):
                continue  # an in-engine LoRA decoder's request: its KV stays in this engine's prefix cache
            n = req.num_prompt_tokens
            after = before + scheduler_output.num_scheduled_tokens.get(rid, 0)
            if before < n <= after and n >= 2:
                spec = self._save_spec(req)
                if spec is not None:
                    saves.append(spec)
        return saves

    def _save_spec(self, req: Request) -> SaveSpec | None:
        keys = self.keys_of(req)
        block_ids = self.block_ids(req.request_id)
        if len(block_ids) < len(keys):
            log.warning("PrefillShare: request %s has %d blocks for %d keys; not saved",
                        req.request_id, len(block_ids), len(keys))
            return None
        params = req.kv_transfer_params or {}
        try:
            pins = max(int(params.get("fanout", 0)), 0)
        except (TypeError, ValueError):
            pins = 0
        self._report[req.request_id] = {"prefill_module_id": self.settings.module_id,
                                        "shared_tokens": shared_length(req.num_prompt_tokens),
                                        "blocks": len(keys), "last_key": keys[-1].key if keys else None}
        return SaveSpec(req.request_id, [k.key for k in keys], [k.num_tokens for k in keys],
                        list(block_ids[: len(keys)]), pins)

    def block_ids(self, rid: str) -> list[int]:
        """The request's KV block ids (first cache group), for saving. vLLM >= 0.27 binds its block
        manager to the connector; older ones (vllm 0.26, the CUDA build that matches torch 2.11) do
        not, so the ids the scheduler announced are tracked (:meth:`track_blocks`)."""
        if self.block_manager is not None:
            return list(self.block_manager.get_block_ids(rid)[0])
        return self._blocks.get(rid, [])

    def track_blocks(self, scheduler_output: SchedulerOutput) -> None:
        for r in scheduler_output.scheduled_new_reqs:
            self._blocks[r.req_id] = list(r.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new in zip(cached.req_ids, cached.new_block_ids):
            if rid in cached.resumed_req_ids:
                self._blocks[rid] = list(new[0]) if new else []
            elif new:
                self._blocks.setdefault(rid, []).extend(new[0])

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Forget the request, count its private prefill once; its report (``kv_transfer_params``)."""
        rid = request.request_id
        for memo in (self._requests, self._blocks, self._keys, self._plans, self._loading):
            memo.pop(rid, None)
        ready = self._ready.pop(rid, None)
        if ready is not None and ready.lease is not None:  # finished before its load was sent
            self.store.release(ready.lease)
        report = self._report.pop(rid, None)
        if report and not report.pop("counted", False) and report.get("fallback"):
            self.store.add(self.settings.scope, {"misses": 1, f"fallback:{report['fallback']}": 1})
        self.store.flush()  # a request that loaded nothing: its one transaction (none when nothing is pending)
        return {"prefillshare": report} if report else None

    def shutdown(self) -> None:
        self.store.close()
