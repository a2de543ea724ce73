"""Orchestrator: runs prefill -> decode for completions and multi-agent workflows.

A request's path: group the agents by the prefill module their decoder consumes, ask one
replica of that module (chosen by the prefix router) to compute the shared context once and
each agent's prompt but its last token, then stream every decoder concurrently. Decoders
without a compatible module prefill privately; a prefill failure, or no prefill replica taking
the call within ``plan.prefill_wait_s``, degrades to private prefill; decode calls prefer a
replica on the prefill's node (deployments/node_router.py);
a failing agent is reported for that agent while the others finish. In multi-round runs each
round's outputs join the context of the next round. When an engine deployment's queue is full
(Serve's BackPressureError) the agent fails with an ``overloaded`` error instead of waiting, so
the ingress can answer 429. Every prefill and decode call carries the tenant's cache salt.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments.messages import (
    AgentEvent,
    AgentRunRequest,
    AppPlan,
    CompletionJob,
    DecodeChunk,
    DecodeRequest,
    PrefillRequest,
    PrefillTicket,
    SamplingSpec,
)
from deployments.metrics import RequestRecord
from deployments.prompts import Prompter, common_prefix, locality_keys


@dataclass
class _Agent:
    """Per-agent state of one round."""

    index: int
    name: str
    model: str
    prompt: list[int]
    sampling: SamplingSpec
    ticket: PrefillTicket | None = None
    ticket_index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    error: str | None = None

    def result(self, round_: int) -> dict:
        return {
            "round": round_,
            "name": self.name,
            "model": self.model,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "usage": {
                "prompt_tokens": len(self.prompt),
                "completion_tokens": len(self.token_ids),
                "cached_tokens": self.num_cached_tokens,
            },
            "prefill": None if self.ticket is None else {
                "module": self.ticket.prefill_module,
                "replica": self.ticket.replica_id,
            },
        }


@serve.deployment(name="Orchestrator")
class Orchestrator:
    def __init__(self, plan: AppPlan, prefill: dict, decoders: dict, metrics=None):
        self.plan = plan
        self.prefill_handles = prefill
        self.decode_handles = {k: h.options(stream=True) for k, h in decoders.items()}
        self.metrics = metrics
        self.prompter = Prompter(plan.tokenizer)

    # --- building blocks -------------------------------------------------------------
    def _fallback(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.fallback.remote(reason, 1)

    async def _prefill_group(self, module: str, agents: list[_Agent], request_id: str,
                             salt: str | None) -> None:
        """One prefill call for all agents on ``module``; on failure they prefill privately,
        except when the prefill deployment sheds load: then they fail as overloaded."""
        mp = self.plan.module(module)
        prompts = [a.prompt for a in agents]
        shared = common_prefix(prompts) if len(prompts) > 1 else []
        # Route on the shared context (or the prompt's handed-over part for a single prompt).
        route_on = shared if shared else prompts[0][:-1]
        req = PrefillRequest(
            request_id=request_id,
            prompts=tuple(tuple(p) for p in prompts),
            shared_prefix=tuple(shared),
            locality_keys=locality_keys(mp.module_id, route_on, mp.block_size, salt),
            cache_salt=salt,
            adapters=tuple(self.plan.decoder(a.model).prefill_adapter for a in agents),
        )
        resp = self.prefill_handles[module].prefill.remote(req)
        try:
            # Serve holds a call while the deployment has no replica (its node is gone): bound that wait
            ref = await asyncio.wait_for(resp._to_object_ref(), self.plan.prefill_wait_s)
            ticket: PrefillTicket = await ref
        except BackPressureError as e:
            for a in agents:
                a.error = f"overloaded: prefill module {module}: {e}"
            return
        except TimeoutError:
            resp.cancel()
            self._fallback("prefill_unavailable")
            return
        except Exception:  # noqa: BLE001 - the decoders prefill privately instead
            self._fallback("prefill_error")
            return
        for i, a in enumerate(agents):
            a.ticket, a.ticket_index = ticket, i

    async def _prefill_all(self, agents: list[_Agent], request_id: str, salt: str | None) -> None:
        groups: dict[str, list[_Agent]] = {}
        for a in agents:
            dp = self.plan.decoder(a.model)
            if dp.prefill_module is None:
                self._fallback(dp.private_reason or "private")
            elif len(a.prompt) > 1:
                groups.setdefault(dp.prefill_module, []).append(a)
        await asyncio.gather(*[self._prefill_group(m, g, f"{request_id}-{m}", salt) for m, g in groups.items()])

    async def _decode(self, a: _Agent, request_id: str, route: str, t0: float,
                      salt: str | None) -> AsyncIterator[DecodeChunk]:
        """Stream one agent's decoder; always ends with a finished chunk; records metrics.
        Latencies count from ``t0``, when the request reached the orchestrator (prefill included)."""
        dp = self.plan.decoder(a.model)
        expect = len(a.prompt) - 1 if a.ticket is not None else 0
        params = None
        if a.ticket is not None and a.ticket.kv_transfer_params:
            params = a.ticket.kv_transfer_params[a.ticket_index]
        req = DecodeRequest(request_id=request_id, prompt_token_ids=tuple(a.prompt), sampling=a.sampling,
                            kv_transfer_params=params, cache_salt=salt,
                            prefer_node=a.ticket.node_id if a.ticket is not None else None, adapter=dp.adapter)
        try:
            async for chunk in self.decode_handles[a.model].generate.remote(req):
                if chunk.error:
                    a.error = chunk.error
                else:
                    if a.ttft_s is None and chunk.delta_token_ids:
                        a.ttft_s = time.perf_counter() - t0
                    a.text += chunk.delta_text
                    a.token_ids.extend(chunk.delta_token_ids)
                    a.num_cached_tokens = chunk.num_cached_tokens
                    a.finish_reason = chunk.finish_reason
                if a.ticket is not None:
                    chunk.prefill_module, chunk.prefill_replica = a.ticket.prefill_module, a.ticket.replica_id
                yield chunk
        except BackPressureError as e:
            a.error = f"overloaded: decoder {a.model}: {e}"
            yield DecodeChunk(request_id, a.model, "", [], True, "error", error=a.error)
        except Exception as e:  # noqa: BLE001 - a dead replica fails this agent only
            a.error = f"decoder_unavailable: {type(e).__name__}: {e}"
            yield DecodeChunk(request_id, a.model, "", [], True, "error", error=a.error)
        if expect and a.error is None and a.num_cached_tokens == 0:
            self._fallback("kv_miss")
        if self.metrics is not None:
            self.metrics.request.remote(RequestRecord(
                model=a.model, agent=a.name, route=route, ttft_s=a.ttft_s, e2e_s=time.perf_counter() - t0,
                prompt_tokens=len(a.prompt), generated_tokens=len(a.token_ids),
                shared_tokens_expected=expect, shared_tokens_loaded=a.num_cached_tokens,
                kv_bytes_per_token=dp.kv_bytes_per_token, ok=a.error is None))

    # --- OpenAI completions ----------------------------------------------------------
    async def complete(self, job: CompletionJob) -> AsyncIterator[DecodeChunk]:
        """One decoder over one prompt: prefill on the shared base, then stream."""
        t0 = time.perf_counter()
        a = _Agent(0, "", job.model, list(job.prompt_token_ids), job.sampling)
        await self._prefill_all([a], job.request_id, job.cache_salt)
        if a.error is not None:
            yield DecodeChunk(job.request_id, job.model, "", [], True, "error", error=a.error)
            return
        async for chunk in self._decode(a, job.request_id, job.route, t0, job.cache_salt):
            yield chunk

    # --- agent workflows -------------------------------------------------------------
    async def run(self, req: AgentRunRequest) -> AsyncIterator[AgentEvent]:
        """Rounds of concurrent agents over one context; events stream as they happen."""
        context = req.context
        all_results: list[dict] = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                 "shared_prefix_tokens": 0, "prefill_tokens_computed": 0}
        for r, specs in enumerate(req.rounds):
            t0 = time.perf_counter()
            agents = [_Agent(i, s.name, s.model, self.prompter.agent_prompt(context, s.instruction), s.sampling)
                      for i, s in enumerate(specs)]
            ready: list[_Agent] = []
            for a in agents:
                limit = self.plan.decoder(a.model).max_model_len
                if len(a.prompt) + a.sampling.max_tokens > limit:
                    a.error = (f"context_length_exceeded: round {r} prompt has {len(a.prompt)} tokens, "
                               f"+{a.sampling.max_tokens} new exceeds {limit}")
                else:
                    ready.append(a)
            rid = f"{req.request_id}-r{r}"
            await self._prefill_all(ready, rid, req.cache_salt)
            ready = [a for a in ready if a.error is None]  # the rest were shed by an overloaded prefill
            usage["shared_prefix_tokens"] += len(common_prefix([a.prompt for a in ready])) if len(ready) > 1 else 0
            usage["prefill_tokens_computed"] += sum(
                t.num_computed_tokens for t in {id(a.ticket): a.ticket for a in ready if a.ticket}.values())
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(a: _Agent) -> None:
                async for chunk in self._decode(a, f"{rid}-{a.index}-{uuid.uuid4().hex[:6]}", "agents", t0,
                                                req.cache_salt):
                    if chunk.delta_text:
                        await queue.put(AgentEvent("delta", r, a.name, a.model, chunk.delta_text))
                await queue.put(AgentEvent("agent_done", r, a.name, a.model, result=a.result(r)))

            for a in agents:
                if a.error is not None:
                    await queue.put(AgentEvent("agent_done", r, a.name, a.model, result=a.result(r)))
            tasks = [asyncio.create_task(pump(a)) for a in ready]
            pending = len(agents)
            try:
                while pending:
                    ev = await queue.get()
                    if ev.kind == "agent_done":
                        pending -= 1
                    yield ev
            finally:
                for t in tasks:
                    t.cancel()
            results = [a.result(r) for a in agents]
            all_results.extend(results)
            for a in agents:
                usage["prompt_tokens"] += len(a.prompt)
                usage["completion_tokens"] += len(a.token_ids)
                usage["cached_tokens"] += a.num_cached_tokens
            yield AgentEvent("round_done", r, result={"round": r, "agents": results})
            if req.join_outputs and r + 1 < len(req.rounds):
                joined = "\n".join(f"{a.name}:{a.text.strip()}" for a in agents if a.error is None)
                context = f"{context}\n{joined}" if joined else context
        yield AgentEvent("done", len(req.rounds) - 1, result={"results": all_results, "usage": usage,
                                                              "final_context": context})

    async def ready(self) -> dict:
        return {"deployment": "Orchestrator"}
