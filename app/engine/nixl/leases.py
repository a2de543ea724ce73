"""Per-request logic of the ``vllm-nixl`` hand-over: leases from the base, decoders that pull them.

vLLM's NixlConnector lends one prefill's blocks to ONE decoder engine: a prefill request with
``do_remote_decode`` finishes holding its blocks for ``kv_lease_duration`` seconds and returns the
``kv_transfer_params`` a decoder needs to read them. A fan-out to N decoders therefore takes N
prefill requests with the tenant's ``cache_salt``: after the shared context's, each hits the
prefill engine's prefix cache (:attr:`Lease.computed_tokens` records what it computed).

A decoder that reads after the lease ran out gets released blocks and vLLM only logs it, so
:func:`pull_params` never passes a lease it cannot trust: once less than ``margin_s`` of the lease is
left (queueing, a slow decoder, a dead replica's retry), the decoder prefills privately and the
reason is counted. ``margin_s`` covers the time until the decoder's scheduler has the request and
sends its first lease-renewing heartbeat (every ``kv_lease_duration // 6`` seconds in vLLM).

The replicas use this through the app's hand-over (:class:`prefillshare.app.engine.nixl.handover.NixlHandover`);
nothing here knows of Ray or vLLM's engine.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prefillshare.app.engine.handover import HandOff
from prefillshare.app.engine.nixl import vllm_pairing
from prefillshare.app.prompt_split import shared_length

log = logging.getLogger(__name__)

__all__ = ["Lease", "HandoverCounters", "FALLBACK_REASONS", "default_margin", "usable",
           "lease_of", "pull_params", "count_decode",
           "read_vllm_nixl_counters", "CounterDeltas"]

# Why a decoder request prefilled privately instead of pulling (counted per reason).
# vllm_version: the lease came from a producer of another vLLM (prefillshare.app.engine.nixl.vllm_pairing).
FALLBACK_REASONS = ("no_lease", "lease_expiring", "pull_incomplete", "vllm_version")


def default_margin(lease_s: float) -> float:
    """Lease time a decoder request must still have when it is sent: two of vLLM's heartbeat
    intervals (``lease // 6``) and a second, never more than half the lease."""
    return min(lease_s / 2, 2 * max(1, int(lease_s) // 6) + 1.0)


@dataclass(frozen=True)
class Lease(HandOff):
    """The mode's hand-off: one prefill's blocks, lent to one decoder until ``expires_at`` (``time.time()``: a lease
    travels from the process that prefilled to the decoder's replica, which checks it right before
    its engine takes the request, after any queueing; across nodes the margin covers clock skew)."""

    params: dict[str, Any]       # the producer's kv_transfer_params, passed to the decoder as is
    expires_at: float
    num_prompt_tokens: int
    computed_tokens: int         # prompt tokens the prefill engine computed (not prefix-cache hits)
    request_id: str

    def remaining(self, now: float | None = None) -> float:
        return self.expires_at - (time.time() if now is None else now)


@dataclass
class HandoverCounters:
    """A decode replica's pulls and private fallbacks by reason."""

    pulls: int = 0
    pulled_tokens: int = 0
    fallbacks: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, int]:
        out = {"pulls": self.pulls, "pulled_tokens": self.pulled_tokens}
        out.update({f"fallback:{r}": int(self.fallbacks.get(r, 0)) for r in FALLBACK_REASONS})
        return out


def lease_of(result, sent: float, lease_s: float) -> Lease:
    """The lease a prefill request (a PrefillResult, sent with ``do_remote_decode`` at ``sent``,
    ``time.time()``) returned. The producer's lease starts when it finishes the request, after the
    send: counting from the send errs on the safe side."""
    return Lease(dict(result.kv_transfer_params or {}), sent + lease_s, result.num_prompt_tokens,
                 result.num_computed_tokens, result.request_id)


def usable(lease: Lease | None, margin_s: float, now: float | None = None) -> str | None:
    """None if a decoder may pull ``lease`` now, else the fallback reason."""
    if lease is None or not lease.params.get("remote_block_ids") or not lease.params.get("do_remote_prefill"):
        return "no_lease"
    if lease.remaining(now) < margin_s:
        return "lease_expiring"
    mismatch = vllm_pairing.refusal(lease.params)
    if mismatch is not None:
        log.error("lease %s: %s", lease.request_id, mismatch)
        return "vllm_version"
    return None


def pull_params(lease: Lease | None, margin_s: float) -> tuple[dict[str, Any] | None, str | None]:
    """(the decoder request's ``kv_transfer_params``, None) when it may pull ``lease`` now, else
    (None, the fallback reason): it then prefills privately."""
    reason = usable(lease, margin_s)
    if reason or lease is None:
        return None, reason or "no_lease"
    params = dict(lease.params)
    # vLLM would report the PREFILL engine's prefix-cache hits as the decoder's cached tokens;
    # without this key the decoder reports its own (the pulled prompt, L-1 tokens).
    params.pop("remote_prefill_cached_tokens", None)
    return params, None


def count_decode(counters: HandoverCounters, reason: str | None, num_prompt_tokens: int,
                 num_cached_tokens: int) -> str:
    """Count one decoder request (``reason``: :func:`pull_params`'s); returns the event counted
    (``pull`` or ``fallback:<reason>``)."""
    if reason is None and num_cached_tokens < shared_length(num_prompt_tokens):
        reason = "pull_incomplete"  # vLLM recomputed (kv_load_failure_policy "recompute"): a private prefill
    if reason:
        counters.fallbacks[reason] += 1
        return f"fallback:{reason}"
    counters.pulls += 1
    counters.pulled_tokens += num_cached_tokens
    return "pull"


# vLLM's NIXL counters (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py), as its stat
# logger registers them in the engine's process.
VLLM_NIXL_COUNTERS = ("num_kv_expired_reqs", "num_notifications_after_expiry", "num_failed_transfers",
                      "num_failed_notifications", "num_failed_handshakes")


def read_vllm_nixl_counters(registry=None) -> dict[str, float]:
    """vLLM's NIXL counters and transfer totals in this process (its stat logger's registry), by
    short name: ``num_kv_expired_reqs``, ``num_notifications_after_expiry``, ...,
    ``bytes_transferred_sum``, ``xfer_time_seconds_sum``, ``xfer_time_seconds_count``."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    out = dict.fromkeys(VLLM_NIXL_COUNTERS, 0.0)
    for metric in registry.collect():
        if not metric.name.startswith("vllm:nixl_"):
            continue
        for s in metric.samples:
            if s.name.endswith(("_total", "_sum", "_count")):
                key = s.name.removeprefix("vllm:nixl_").removesuffix("_total")
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


class CounterDeltas:
    """Increments of monotone counters since the last call: what a replica sends to the app's
    Metrics deployment (``AppMetrics.handover_events``) after each scrape of its own counters."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, now: dict[str, float]) -> dict[str, float]:
        out = {k: v - self._last.get(k, 0.0) for k, v in now.items() if v > self._last.get(k, 0.0)}
        self._last.update(now)
        return out
