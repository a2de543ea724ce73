"""Hand-over ``vllm-nixl``: vLLM's NixlConnector, one lease of the base's blocks per decoder.

Each prompt's prefill finishes holding its blocks for ``kv_lease_duration`` seconds and its
ticket carries the lease (:mod:`prefillshare.app.engine.nixl.leases`); the decoder's replica checks the lease
right before its engine takes the request and pulls, or prefills privately and counts why.
Engine settings: :mod:`prefillshare.app.engine.nixl.config`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from prefillshare.app.engine.handover import DecodeSide, EventCounter, HandOff, Handover, ModuleLink, Pull, Role
from prefillshare.app.engine.nixl import leases
from prefillshare.app.engine.nixl.config import lease_for_timeout, nixl_transfer_config, side_channel_env
from prefillshare.app.engine.nixl.side_channel_auth import REFUSED_METRIC
from prefillshare.app.prompt_split import shared_length

if TYPE_CHECKING:
    from prefillshare.app.config import AppConfig

__all__ = ["NixlHandover", "NixlDecodeSide"]


@dataclass(frozen=True)
class NixlHandover(Handover):
    """``lease_s``: how long a finished prefill keeps its blocks for its decoder's pull (vLLM's
    ``kv_lease_duration``; :meth:`for_timeout` ties it to the request timeout)."""

    lease_s: int
    engine_metrics = frozenset({REFUSED_METRIC})  # side-channel handshakes refused (side_channel_auth.py)
    # vLLM's NIXL counters of each decoder's engine (num_kv_expired_reqs, ...) and the pulls' own
    # (pull, fallback:<reason>), sent as increments by NixlDecodeSide.finished
    decode_events = EventCounter("prefillshare_vllm_nixl_events",
                                 "vLLM NixlConnector hand-over counters by module and event")

    @classmethod
    def from_config(cls, cfg: AppConfig) -> NixlHandover:
        return cls.for_timeout(cfg.limits.request_timeout_s, cfg.kv_lease_duration)

    @classmethod
    def for_timeout(cls, request_timeout_s: float, lease_s: int | None = None) -> NixlHandover:
        """A lease of ``lease_s``, else one that outlasts a request (it never runs out while the
        request that reads it may still be waiting; a lease too short to trust is never sent)."""
        return cls(lease_s or lease_for_timeout(request_timeout_s))

    def transfer_config(self, role: Role, link: ModuleLink, *, on_gpu: bool = False) -> dict[str, Any]:
        # vLLM's handshake no longer compares models (enforce_handshake_compat off): the plan's
        # compatibility check (prefillshare.app.models.compat) decides who reads which base
        return nixl_transfer_config(role, lease_s=self.lease_s, kv_buffer_device="cuda" if on_gpu else "cpu")

    def on_node(self, engine_config, host: str):
        """Each engine listens for NIXL handshakes on its own free port of its node."""
        return replace(engine_config, extra_env={**engine_config.extra_env, **side_channel_env(host=host)})

    def prefill_params(self) -> dict[str, Any]:
        return {"do_remote_decode": True}

    def handoffs(self, results: Sequence[Any], sent: float) -> tuple[HandOff | None, ...]:
        return tuple(None if r is None else leases.lease_of(r, sent, self.lease_s) for r in results)

    def decode_side(self) -> NixlDecodeSide:
        return NixlDecodeSide(leases.default_margin(self.lease_s))


class NixlDecodeSide(DecodeSide):
    """A decoder replica's pulls: the lease rule (``margin_s`` of lease left, else a private
    prefill), the fallbacks by reason, and vLLM's NIXL counters' increments."""

    def __init__(self, margin_s: float) -> None:
        self.margin_s = margin_s
        self.counters = leases.HandoverCounters()
        self._deltas = leases.CounterDeltas()

    def pull(self, handoff: HandOff | None) -> Pull | None:
        if handoff is None:  # a request that never had a prefill (a private decoder's)
            return None
        if not isinstance(handoff, leases.Lease):
            raise TypeError(f"a vllm-nixl decoder got a {type(handoff).__name__} hand-off, not a Lease")
        params, reason = leases.pull_params(handoff, self.margin_s)
        return Pull(params, reason)

    def cached_tokens(self, pull: Pull, num_prompt_tokens: int, num_cached_tokens: int) -> int:
        # vLLM counts the pulled last prompt token as cached too, though the decoder recomputes it
        # with its own weights: the base's part is the hand-over convention's L-1, as in the pool
        if pull.params is None:
            return num_cached_tokens
        return min(num_cached_tokens, shared_length(num_prompt_tokens))

    def finished(self, pull: Pull, num_prompt_tokens: int, num_cached_tokens: int) -> dict[str, float]:
        event = leases.count_decode(self.counters, pull.reason, num_prompt_tokens, num_cached_tokens)
        return {event: 1, **self._deltas(leases.read_vllm_nixl_counters())}
