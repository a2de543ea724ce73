"""Prefill fan-out and decode planning: a request's path below the ingress, without Ray.

A request names the decoders it needs and their prompts (:class:`Leg`). :class:`FanOut`
groups the legs by the prefill module their decoder consumes and asks that module once per
group to compute the shared context and each prompt but its last token; the prefill
deployment's prefix router picks the replica from ``PrefillRequest.locality_keys``, salted by
the tenant. Each leg then becomes a :class:`DecodePlan`: the decoder request (cache salt, the
prefill's node to prefer, the LoRA adapter of a decode group) or the failure that ended it
before decoding. Decoders without a compatible module prefill privately (their reason is
counted); a prefill call whose replica died is repeated once (Serve routes the repeat to a
surviving replica); a prefill that fails again, or that no replica takes within
``limits.prefill_wait_s``, degrades to private prefill; a prefill deployment that sheds the call (:class:`Shed`) fails
its legs as ``overloaded``. A leg whose decoder has no replica running (it died and restarts)
fails as ``decoder_unavailable`` before any prefill: the base's work and the caller's admission
slot go to requests that can be answered. A leg whose decoder is *cold* (its autoscaler stopped
the last replica, ``min_replicas: 0``) starts it and waits for it before the prefill, when the
measured engine start fits ``WAKE_SHARE`` of ``limits.request_timeout_s``; otherwise it fails as
``decoder_unavailable`` with that start as its Retry-After. :meth:`FanOut.decode` streams a plan (deployments/path/decode_call.py).
The prefill's ticket may carry a hand-off per prompt (the mode's, opaque here: vllm-nixl's lease
of the base's blocks); each decoder request carries its own prompt's.

The Router runs it for a completion (one leg), the Orchestrator for each round of an agent
run. The engines come in as :class:`Engines`: Ray Serve handles in the app
(deployments/path/serve_engines.py), fakes in tests (tests/test_fanout.py).
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefillshare.app.plan import AppPlan
from prefillshare.app.prompt_split import split_prompt
from prefillshare.app.sampling import Sampling, private_prefill_reason
from prefillshare.deployments.errors import ErrorCode, Failure, Shed, Unreachable
from prefillshare.deployments.messages import DecodeRequest, PrefillRequest, PrefillTicket
from prefillshare.deployments.path.decode_call import DecodePlan, DecoderCall, Output
from prefillshare.deployments.path.engines import Engines
from prefillshare.deployments.prompts import common_prefix
from prefillshare.deployments.routing.locality import locality_keys

# The share of limits.request_timeout_s a request may spend waiting for a cold decoder to start;
# the rest is for its prefill and its answer.
WAKE_SHARE = 0.75


@dataclass(frozen=True)
class Leg:
    """One decoder's part of a request: which decoder runs which prompt, under which id."""

    request_id: str  # the decoder request's id
    model: str  # the served decoder name
    prompt: tuple[int, ...]
    sampling: Sampling
    agent: str = ""  # "" for an OpenAI completion


@dataclass
class _Prefilled:
    leg: Leg
    ticket: PrefillTicket | None = None
    error: Failure | None = None
    index: int = 0  # this leg's prompt in its group's prefill call (its hand-off in the ticket)


class FanOut:
    def __init__(self, plan: AppPlan, engines: Engines):
        self.plan, self.engines = plan, engines

    async def prepare(self, legs: Sequence[Leg], request_id: str, route: str,
                      salt: str | None) -> list[DecodePlan]:
        """The decoder request of each leg (same order) after its prefill, shared or private.
        ``request_id`` names the prefill calls (one per module: ``<request_id>-<module>``)."""
        done = [_Prefilled(leg) for leg in legs]
        groups: dict[str, list[_Prefilled]] = {}  # legs whose module prefills and hands over, by module
        served: dict[str, list[_Prefilled]] = {}  # legs every module serves: the locality keys' prompts
        still_cold = await self._wake({p.leg.model for p in done if self.engines.decoder_cold(p.leg.model)})
        for p in done:
            dp = self.plan.decoder(p.leg.model)
            if p.leg.model in still_cold:
                p.error = Failure(ErrorCode.DECODER_UNAVAILABLE, f"decoder {p.leg.model}: scaled to zero while idle; "
                                  f"a replica is starting (about {still_cold[p.leg.model]} s)",
                                  retry_after_s=still_cold[p.leg.model])
            elif self.engines.decoder_down(p.leg.model):
                p.error = Failure(ErrorCode.DECODER_UNAVAILABLE, f"decoder {p.leg.model}: no replica is running "
                                  "(it is restarting)")
            elif dp.in_engine and dp.prefill_module is not None:  # its module's engine serves it: no prefill apart
                served.setdefault(dp.prefill_module, []).append(p)
            elif dp.prefill_module is None:
                self.engines.fallback(dp.private_reason or "private")
            elif (reason := private_prefill_reason(p.leg.sampling)) is not None:  # e.g. the decoder's own prompt logprobs
                self.engines.fallback(reason)
            elif len(p.leg.prompt) > 1:  # a one-token prompt has nothing to hand over
                groups.setdefault(dp.prefill_module, []).append(p)
                served.setdefault(dp.prefill_module, []).append(p)
        keys = {m: self._locality_keys(m, [p.leg.prompt for p in g], salt) for m, g in served.items()}
        await asyncio.gather(*[self._prefill_group(m, g, f"{request_id}-{m}", salt, keys[m])
                               for m, g in groups.items()])
        return [self._decode_plan(p, route, salt, keys) for p in done]

    async def _wake(self, models: set[str]) -> dict[str, int]:
        """Start every cold decoder of a request at once; {model: expected start, s} of those not up
        within the request's share (WAKE_SHARE)."""
        if not models:
            return {}
        budget = WAKE_SHARE * self.plan.limits.request_timeout_s
        order = sorted(models)
        waits = await asyncio.gather(*[self.engines.wake(m, budget) for m in order])
        return {m: max(1, math.ceil(w)) for m, w in zip(order, waits) if w is not None}

    def decode(self, plan: DecodePlan, t0: float, output: Output | None = None) -> DecoderCall:
        """A prepared plan's decoder call (accumulating into ``output`` when given); latencies
        count from ``t0`` (the prefill included)."""
        limits = self.plan.limits
        return DecoderCall(self.engines, plan, t0, output, limits.decoder_wait_s, t0 + limits.request_timeout_s)

    def _locality_keys(self, module: str, prompts: list[tuple[int, ...]], salt: str | None) -> tuple[str, ...]:
        """The keys a module's calls of one request route on: its shared context's (for a single
        prompt: its handed-over part), so every call of a fan-out lands on one replica."""
        mp = self.plan.module(module)
        shared = common_prefix(prompts) if len(prompts) > 1 else []
        route_on = shared if shared else split_prompt(list(prompts[0]))[0]
        return tuple(locality_keys(mp.module_id, route_on, mp.block_size, salt))

    async def _prefill_group(self, module: str, group: list[_Prefilled], request_id: str,
                             salt: str | None, keys: tuple[str, ...]) -> None:
        """One prefill call for every leg on ``module``: the shared context first, then each prompt."""
        prompts = [p.leg.prompt for p in group]
        shared = common_prefix(prompts) if len(prompts) > 1 else []
        req = PrefillRequest(
            request_id=request_id,
            prompts=tuple(tuple(p) for p in prompts),
            shared_prefix=tuple(shared),
            locality_keys=keys,
            cache_salt=salt,
            adapters=tuple(self.plan.decoder(p.leg.model).prefill_adapter for p in group),
        )
        for attempt in range(2):
            try:
                ticket = await self.engines.prefill(module, req, self.plan.limits.prefill_wait_s)
                break
            except Shed as e:
                for p in group:
                    p.error = Failure(ErrorCode.OVERLOADED, f"prefill module {module}: {e}")
                return
            except Unreachable:
                self.engines.fallback("prefill_unavailable")
                return
            except Exception:  # noqa: BLE001 - its replica died: once more on a survivor, then privately
                if attempt == 0:
                    self.engines.fallback("prefill_retry")
                    continue
                self.engines.fallback("prefill_error")
                return
        for i, p in enumerate(group):
            p.ticket, p.index = ticket, i

    def _decode_plan(self, p: _Prefilled, route: str, salt: str | None, keys: dict[str, tuple[str, ...]]) -> DecodePlan:
        leg, t = p.leg, p.ticket
        dp = self.plan.decoder(leg.model)
        req = DecodeRequest(request_id=leg.request_id, prompt_token_ids=tuple(leg.prompt), sampling=leg.sampling,
                            cache_salt=salt, prefer_node=t.node_id if t is not None else None, adapter=dp.adapter,
                            handoff=t.handoff(p.index) if t is not None else None,
                            locality_keys=keys.get(dp.prefill_module or "", ()) if dp.in_engine else ())
        return DecodePlan(req, leg.model, leg.agent, route, ticket=t, kv_bytes_per_token=dp.kv_bytes_per_token,
                          error=p.error)
