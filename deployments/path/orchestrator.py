"""Orchestrator: multi-agent workflows, prefill -> decode for every agent of every round.

A run's path: each round's agents go through deployments/path/fanout.py (the same library the
Router runs for a completion): grouped by the prefill module their decoder consumes, one
replica of that module (chosen by the prefix router) computes the shared context once and each
agent's prompt but its last token; then every decoder streams concurrently and this deployment
merges their streams into the run's events. Decoders without a compatible module prefill
privately; a prefill failure, or no prefill replica taking the call within
``limits.prefill_wait_s``, degrades to private prefill; decode calls prefer a replica on the
prefill's node (deployments/routing/node_router.py); a failing agent is reported for that agent (its
typed code in the result) while the others finish. In multi-round runs each round's outputs
join the context of the next round. When an engine deployment's queue is full (Serve's
back-pressure) the agent fails as ``overloaded`` instead of waiting. Every prefill and decode
call carries the tenant's cache salt.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from prefillshare.app.plan import AppPlan
from prefillshare.app.sampling import Sampling
from prefillshare.deployments.errors import ErrorCode, Failure, failure_fields
from prefillshare.deployments.fleet import ReplicaBounds, serve_fleet
from prefillshare.deployments.logprobs import chat_logprobs
from prefillshare.deployments.messages import AgentEvent, AgentRunRequest, AgentSpec
from prefillshare.deployments.metrics import MetricsSender
from prefillshare.deployments.path.decode_call import DecodePlan, Output
from prefillshare.deployments.path.fanout import FanOut, Leg
from prefillshare.deployments.path.serve_engines import ServeEngines
from prefillshare.deployments.prompts import Prompter, common_prefix


@dataclass
class _Agent:
    """Per-agent state of one round: its prompt, its prepared decoder request, its output."""

    index: int
    name: str
    model: str
    prompt: list[int]
    sampling: Sampling
    plan: DecodePlan | None = None
    output: Output = field(default_factory=Output)

    @property
    def error(self) -> Failure | None:
        return self.output.error

    def result(self, round_: int) -> dict:
        first, output = self.output.seq(0), self.output
        out: dict[str, Any] = {
            "round": round_,
            "name": self.name,
            "model": self.model,
            "text": first.text,
            "token_ids": first.token_ids,
            "finish_reason": first.finish_reason,
            **failure_fields(self.error),
            "usage": {
                "prompt_tokens": len(self.prompt),
                "completion_tokens": self.output.num_generated,
                "cached_tokens": self.output.num_cached_tokens,
            },
            "prefill": None if output.prefill_module is None else {"module": output.prefill_module,
                                                                   "replica": output.prefill_replica},
        }
        if self.sampling.n > 1 or self.sampling.logprobs is not None:  # every sequence, OpenAI's chat shape
            out["choices"] = [
                {"index": i, "text": q.text, "token_ids": q.token_ids, "finish_reason": q.finish_reason,
                 "logprobs": chat_logprobs(q.logprobs) if self.sampling.logprobs is not None else None}
                for i, q in sorted(self.output.seqs.items())]
        return out


@serve.deployment(name="Orchestrator")
class Orchestrator:
    def __init__(self, plan: AppPlan, prefill: dict, decoders: dict, metrics=None,
                 bounds: dict[str, ReplicaBounds] | None = None):
        self.plan = plan
        self.events = MetricsSender(metrics) if metrics is not None else None
        # which decoders are cold (their autoscaler stopped them); polled only when one may be
        self.fleet = serve_fleet({n: b for n, b in (bounds or {}).items() if b.can_sleep})
        self.fleet.start()
        self.fanout = FanOut(plan, ServeEngines(prefill, decoders, self.events, self.fleet))
        self.prompter = Prompter(plan.tokenizer, plan.renderers)  # each decoder's own rendering

    def _prompt(self, spec: AgentSpec, context: str, round_: int) -> list[int]:
        """The agent's prompt ids: the Router's own for the first round (tokenized once there),
        rendered here for later rounds, whose context holds the earlier rounds' outputs."""
        if round_ == 0 and spec.prompt_token_ids:
            return list(spec.prompt_token_ids)
        return self.prompter.agent_prompt(context, spec.instruction, model=spec.model)

    # --- agent workflows -------------------------------------------------------------
    async def run(self, req: AgentRunRequest) -> AsyncIterator[AgentEvent]:
        """Rounds of concurrent agents over one context; events stream as they happen."""
        self.fleet.start()
        if self.events is not None:
            self.events.send("agent_run")
        context = req.context
        all_results: list[dict] = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                 "shared_prefix_tokens": 0, "prefill_tokens_computed": 0}
        for r, specs in enumerate(req.rounds):
            t0 = time.perf_counter()
            agents = [_Agent(i, s.name, s.model, self._prompt(s, context, r), s.sampling)
                      for i, s in enumerate(specs)]
            ready = await self._prepare_round(agents, r, f"{req.request_id}-r{r}", req.cache_salt)
            usage["shared_prefix_tokens"] += len(common_prefix([a.prompt for a in ready])) if len(ready) > 1 else 0
            tickets = {id(a.plan.ticket): a.plan.ticket for a in ready if a.plan is not None and a.plan.ticket is not None}
            usage["prefill_tokens_computed"] += sum(t.num_computed_tokens for t in tickets.values())
            async for ev in self._stream_round(agents, ready, r, t0):
                yield ev
            results = [a.result(r) for a in agents]
            all_results.extend(results)
            for a in agents:
                usage["prompt_tokens"] += len(a.prompt)
                usage["completion_tokens"] += a.output.num_generated
                usage["cached_tokens"] += a.output.num_cached_tokens
            yield AgentEvent("round_done", r, result={"round": r, "agents": results})
            if req.join_outputs and r + 1 < len(req.rounds):
                joined = "\n".join(f"{a.name}:{a.output.seq(0).text.strip()}" for a in agents if a.error is None)
                context = f"{context}\n{joined}" if joined else context
        yield AgentEvent("done", len(req.rounds) - 1, result={"results": all_results, "usage": usage,
                                                              "final_context": context})

    async def _prepare_round(self, agents: list[_Agent], r: int, rid: str, salt: str | None) -> list[_Agent]:
        """Prefill a round's agents (fanout.py); those left to decode. An agent whose prompt
        outgrew its decoder's context, or whose prefill module shed the call, fails here."""
        fits: list[_Agent] = []
        for a in agents:
            limit = self.plan.decoder(a.model).max_model_len
            if len(a.prompt) + (a.sampling.max_tokens or 1) > limit:  # None: the Router always fills it
                a.output.error = Failure(ErrorCode.CONTEXT_LENGTH, f"round {r} prompt has {len(a.prompt)} tokens, "
                                         f"+{a.sampling.max_tokens} new exceeds {limit}")
            else:
                fits.append(a)
        legs = [Leg(f"{rid}-{a.index}-{uuid.uuid4().hex[:6]}", a.model, tuple(a.prompt), a.sampling, a.name)
                for a in fits]
        for a, plan in zip(fits, await self.fanout.prepare(legs, rid, "agents", salt)):
            a.plan, a.output.error = plan, plan.error
        return [a for a in fits if a.error is None]

    async def _stream_round(self, agents: list[_Agent], ready: list[_Agent], r: int,
                            t0: float) -> AsyncIterator[AgentEvent]:
        """Every ready agent's decoder at once, merged: text deltas, then one agent_done each
        (the agents that failed before decoding first)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(a: _Agent) -> None:
            assert a.plan is not None, "a ready agent has its decode plan"
            async for chunk in self.fanout.decode(a.plan, t0, a.output).chunks():
                if chunk.delta_text and chunk.index == 0:
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

    async def ready(self) -> dict:
        return {"deployment": "Orchestrator"}
