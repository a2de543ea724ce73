"""Orchestrator: prefill for completions, prefill -> decode for multi-agent workflows.

A request's path: group the agents by the prefill module their decoder consumes, ask one
replica of that module (chosen by the prefix router) to compute the shared context once and
each agent's prompt but its last token, then stream every decoder concurrently. An OpenAI
completion has one decoder: ``prepare`` does its prefill and returns the ready decoder
request, which the Router streams itself (no relay of every token through this deployment). Decoders
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
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray import serve
from ray.serve.exceptions import BackPressureError

from app.handover import shared_length, split_prompt
from app.sampling import Sampling, TokenLogprob
from deployments.decode_call import DecoderCall
from deployments.errors import ErrorCode, Failure
from deployments.messages import (
    AgentEvent,
    AgentRunRequest,
    AgentSpec,
    AppPlan,
    CompletionJob,
    DecodeChunk,
    DecodePlan,
    DecodeRequest,
    PrefillRequest,
    PrefillTicket,
)
from deployments.openai_format import chat_logprobs
from deployments.prompts import Prompter, common_prefix, locality_keys


@dataclass
class _Sequence:
    """One of an agent's ``n`` generated sequences."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, chunk: DecodeChunk) -> None:
        self.text += chunk.delta_text
        self.token_ids.extend(chunk.delta_token_ids)
        self.logprobs.extend(chunk.logprobs or ())
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason


@dataclass
class _Agent:
    """Per-agent state of one round."""

    index: int
    name: str
    model: str
    prompt: list[int]
    sampling: Sampling
    ticket: PrefillTicket | None = None
    seqs: dict[int, _Sequence] = field(default_factory=dict)
    num_cached_tokens: int = 0
    error: Failure | None = None

    @property
    def first(self) -> _Sequence:
        return self.seqs.get(0) or _Sequence()

    @property
    def text(self) -> str:
        return self.first.text

    @property
    def num_generated(self) -> int:
        return sum(len(q.token_ids) for q in self.seqs.values())

    def result(self, round_: int) -> dict:
        first = self.first
        out = {
            "round": round_,
            "name": self.name,
            "model": self.model,
            "text": first.text,
            "token_ids": first.token_ids,
            "finish_reason": first.finish_reason,
            "error": None if self.error is None else str(self.error),
            "error_code": None if self.error is None else self.error.code.value,
            "usage": {
                "prompt_tokens": len(self.prompt),
                "completion_tokens": self.num_generated,
                "cached_tokens": self.num_cached_tokens,
            },
            "prefill": None if self.ticket is None else {
                "module": self.ticket.prefill_module,
                "replica": self.ticket.replica_id,
            },
        }
        if self.sampling.n > 1 or self.sampling.logprobs is not None:  # every sequence, OpenAI's chat shape
            out["choices"] = [
                {"index": i, "text": q.text, "token_ids": q.token_ids, "finish_reason": q.finish_reason,
                 "logprobs": chat_logprobs(q.logprobs) if self.sampling.logprobs is not None else None}
                for i, q in sorted(self.seqs.items())]
        return out


@serve.deployment(name="Orchestrator")
class Orchestrator:
    def __init__(self, plan: AppPlan, prefill: dict, decoders: dict, metrics=None):
        self.plan = plan
        self.prefill_handles = prefill
        self.decode_handles = {k: h.options(stream=True) for k, h in decoders.items()}
        self.metrics = metrics
        self.prompter = Prompter(plan.tokenizer, plan.renderers)  # each decoder's own rendering
        self.prepared = 0  # completions prepared for the Router to stream
        self.relayed_chunks: Counter[str] = Counter()  # decoder chunks streamed through here, by route

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
        route_on = shared if shared else split_prompt(prompts[0])[0]
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
                a.error = Failure(ErrorCode.OVERLOADED, f"prefill module {module}: {e}")
            return
        except TimeoutError:
            resp.cancel()
            self._fallback("prefill_unavailable")
            return
        except Exception:  # noqa: BLE001 - the decoders prefill privately instead
            self._fallback("prefill_error")
            return
        for a in agents:
            a.ticket = ticket

    async def _prefill_all(self, agents: list[_Agent], request_id: str, salt: str | None) -> None:
        groups: dict[str, list[_Agent]] = {}
        for a in agents:
            dp = self.plan.decoder(a.model)
            if dp.prefill_module is None:
                self._fallback(dp.private_reason or "private")
            elif a.sampling.private_prefill_reason is not None:  # e.g. the decoder's own prompt logprobs
                self._fallback(a.sampling.private_prefill_reason)
            elif len(a.prompt) > 1:
                groups.setdefault(dp.prefill_module, []).append(a)
        await asyncio.gather(*[self._prefill_group(m, g, f"{request_id}-{m}", salt) for m, g in groups.items()])

    def _decode_plan(self, a: _Agent, request_id: str, route: str, salt: str | None) -> DecodePlan:
        """The decoder request of agent ``a`` after its prefill (or without one: private)."""
        dp, t = self.plan.decoder(a.model), a.ticket
        req = DecodeRequest(request_id=request_id, prompt_token_ids=tuple(a.prompt), sampling=a.sampling,
                            cache_salt=salt, prefer_node=t.node_id if t is not None else None, adapter=dp.adapter)
        return DecodePlan(req, a.model, a.name, route,
                          shared_tokens_expected=shared_length(len(a.prompt)) if t is not None else 0,
                          kv_bytes_per_token=dp.kv_bytes_per_token,
                          prefill_module=t.prefill_module if t is not None else None,
                          prefill_replica=t.replica_id if t is not None else None, error=a.error)

    async def _decode(self, a: _Agent, request_id: str, route: str, t0: float,
                      salt: str | None) -> AsyncIterator[DecodeChunk]:
        """Stream one agent's decoder into ``a``; always ends with a finished chunk."""
        call = DecoderCall(self.decode_handles[a.model], self._decode_plan(a, request_id, route, salt), t0,
                           self.metrics)
        async for chunk in call.chunks():
            self.relayed_chunks[route] += 1
            if chunk.error:
                a.error = chunk.error
            else:
                a.seqs.setdefault(chunk.index, _Sequence()).add(chunk)
                a.num_cached_tokens = chunk.num_cached_tokens
            yield chunk

    def _prompt(self, spec: AgentSpec, context: str, round_: int) -> list[int]:
        """The agent's prompt ids: the Router's own for the first round (tokenized once there),
        rendered here for later rounds, whose context holds the earlier rounds' outputs."""
        if round_ == 0 and spec.prompt_token_ids:
            return list(spec.prompt_token_ids)
        return self.prompter.agent_prompt(context, spec.instruction, model=spec.model)

    # --- OpenAI completions ----------------------------------------------------------
    async def prepare(self, job: CompletionJob) -> DecodePlan:
        """One decoder over one prompt: the prefill on the shared base (or the private
        fallback); the caller streams the returned request from the decoder itself. A failure
        before decoding (the prefill module shed the call) comes back as ``error``."""
        self.prepared += 1
        a = _Agent(0, "", job.model, list(job.prompt_token_ids), job.sampling)
        await self._prefill_all([a], job.request_id, job.cache_salt)
        return self._decode_plan(a, job.request_id, job.route, job.cache_salt)

    # --- agent workflows -------------------------------------------------------------
    async def run(self, req: AgentRunRequest) -> AsyncIterator[AgentEvent]:
        """Rounds of concurrent agents over one context; events stream as they happen."""
        context = req.context
        all_results: list[dict] = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                 "shared_prefix_tokens": 0, "prefill_tokens_computed": 0}
        for r, specs in enumerate(req.rounds):
            t0 = time.perf_counter()
            agents = [_Agent(i, s.name, s.model, self._prompt(s, context, r), s.sampling)
                      for i, s in enumerate(specs)]
            ready: list[_Agent] = []
            for a in agents:
                limit = self.plan.decoder(a.model).max_model_len
                if len(a.prompt) + a.sampling.max_tokens > limit:
                    a.error = Failure(ErrorCode.CONTEXT_LENGTH, f"round {r} prompt has {len(a.prompt)} tokens, "
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
                    if chunk.delta_text and chunk.index == 0:
                        await queue.put(AgentEvent("delta", r, a.name, a.model, chunk.delta_text))
                await queue.put(AgentEvent("agent_done", r, a.name, a.model, result=a.result(r), error=a.error))

            for a in agents:
                if a.error is not None:
                    await queue.put(AgentEvent("agent_done", r, a.name, a.model, result=a.result(r), error=a.error))
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
                usage["completion_tokens"] += a.num_generated
                usage["cached_tokens"] += a.num_cached_tokens
            yield AgentEvent("round_done", r, result={"round": r, "agents": results})
            if req.join_outputs and r + 1 < len(req.rounds):
                joined = "\n".join(f"{a.name}:{a.text.strip()}" for a in agents if a.error is None)
                context = f"{context}\n{joined}" if joined else context
        yield AgentEvent("done", len(req.rounds) - 1, result={"results": all_results, "usage": usage,
                                                              "final_context": context})

    async def ready(self) -> dict:
        return {"deployment": "Orchestrator"}

    async def counters(self) -> dict:
        """What went through this replica: completions prepared, decoder chunks relayed by route."""
        return {"prepared": self.prepared, "relayed_chunks": dict(self.relayed_chunks)}
