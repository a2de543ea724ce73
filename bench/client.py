"""The load generator's HTTP side: one session = one streamed `POST /v1/agents/run`, or with
``--driver chat`` N streamed `POST /v1/chat/completions` sent together, one per agent, each as an
agent framework sends it: ``[system: the agent's own prompt, user: the shared context]`` and the
agent's ``tools`` (:func:`run_chat_session`).

Timings are taken by the client, so they include every hop a user pays (ingress, orchestrator,
prefill, KV hand-over, decode). A round starts when the session is sent (round 0) or when the
previous round's `round_done` event arrives; an agent's TTFT is its first text delta after
its round started (chat: the first chunk carrying content or a tool call); a round's fan-out
latency ends when all its agents are done.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from bench.systems import decoder_names
from bench.workload import AgentProfile, Session, WorkloadSpec


@dataclass
class AgentTiming:
    round: int
    agent: str
    start: float                 # absolute (perf_counter) start of its round
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class SessionResult:
    index: int
    sent: float                  # perf_counter when sent
    scheduled: float             # when the arrival process wanted it sent
    done: float | None = None
    rounds_s: list[float] = field(default_factory=list)   # fan-out latency per round
    agents: list[AgentTiming] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None and all(a.error is None for a in self.agents)

    @property
    def latency_s(self) -> float | None:
        return None if self.done is None else self.done - self.sent


def request_body(session: Session, spec: WorkloadSpec, models: list[str] | None = None) -> dict:
    """The run's JSON; agent i goes to decoder ``models[i]`` (default agent0..agent{N-1})."""
    models = models or decoder_names(spec.fanout)
    agents = [{"name": nm, "model": nm, "instruction": session.instructions[i], "max_tokens": spec.output_tokens,
               "temperature": 0.0} for i, nm in enumerate(models)]
    return {"context": session.context, "agents": agents, "rounds": spec.rounds, "stream": True}


async def run_session(client, url: str, session: Session, spec: WorkloadSpec, scheduled: float,
                      timeout_s: float, models: list[str] | None = None) -> SessionResult:
    """Send one session and follow its event stream; never raises (errors are recorded)."""
    res = SessionResult(session.index, time.perf_counter(), scheduled)
    round_start = res.sent
    current: dict[str, AgentTiming] = {}

    def agent(r: int, name: str) -> AgentTiming:
        key = f"{r}/{name}"
        if key not in current:
            current[key] = AgentTiming(r, name, round_start)
            res.agents.append(current[key])
        return current[key]

    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url + "/v1/agents/run", json=request_body(session, spec, models),
                                     timeout=timeout_s) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {body[:300]}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    ev = json.loads(data)
                    now = time.perf_counter()
                    kind = ev.get("type")
                    if kind == "delta":
                        a = agent(ev["round"], ev["agent"])
                        if a.ttft_s is None:
                            a.ttft_s = now - a.start
                    elif kind == "agent_done":
                        a = agent(ev["round"], ev["agent"])
                        r = ev.get("result") or {}
                        a.e2e_s = now - a.start
                        if a.ttft_s is None:
                            a.ttft_s = a.e2e_s
                        u = r.get("usage") or {}
                        a.prompt_tokens = int(u.get("prompt_tokens", 0))
                        a.completion_tokens = int(u.get("completion_tokens", 0))
                        a.cached_tokens = int(u.get("cached_tokens", 0))
                        a.error = r.get("error")
                    elif kind == "round_done":
                        res.rounds_s.append(now - round_start)
                        round_start = now
                    elif kind == "done":
                        res.done = now
                    elif "error" in ev:
                        res.error = str(ev["error"].get("message", ev["error"]))
        if res.done is None and res.error is None:
            res.error = "stream ended without a done event"
    except TimeoutError:
        res.error = f"timeout after {timeout_s:.0f}s"
    except Exception as e:  # noqa: BLE001 - a failed session is a data point, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


def chat_bodies(session: Session, spec: WorkloadSpec, profiles: list[AgentProfile]) -> list[dict]:
    """One streamed chat completion per agent: its system prompt, the session's context as the user
    turn, its tools (tool_choice left to the default, auto), usage in the last chunk."""
    return [{"model": p.model, "messages": [{"role": "system", "content": p.system},
                                            {"role": "user", "content": session.context}],
             **({"tools": list(p.tools)} if p.tools else {}), "max_tokens": spec.output_tokens, "temperature": 0.0,
             "stream": True, "stream_options": {"include_usage": True}} for p in profiles[:spec.fanout]]


def _read_chat_event(ev: dict, a: AgentTiming, now: float) -> None:
    """One chunk of a streamed chat completion into ``a``: the first content or tool call, the usage."""
    if "error" in ev:
        a.error = str(ev["error"].get("message", ev["error"]) if isinstance(ev["error"], dict) else ev["error"])
    for ch in ev.get("choices") or []:
        d = ch.get("delta") or {}
        if a.ttft_s is None and (d.get("content") or d.get("tool_calls")):
            a.ttft_s = now - a.start
    u = ev.get("usage")
    if u:
        a.prompt_tokens, a.completion_tokens = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
        a.cached_tokens = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def _chat_request(client, url: str, body: dict, a: AgentTiming, timeout_s: float) -> None:
    """Send one chat completion and follow its stream into ``a``; never raises (errors are recorded)."""
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout_s) as resp:
                if resp.status_code != 200:
                    a.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                    return
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line[6:] != "[DONE]":
                        _read_chat_event(json.loads(line[6:]), a, time.perf_counter())
        a.e2e_s = time.perf_counter() - a.start
        if a.ttft_s is None:
            a.ttft_s = a.e2e_s
    except TimeoutError:
        a.error = f"timeout after {timeout_s:.0f}s"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        a.error = f"{type(e).__name__}: {e}"


async def run_chat_session(client, url: str, session: Session, spec: WorkloadSpec, scheduled: float,
                           timeout_s: float, profiles: list[AgentProfile]) -> SessionResult:
    """The N agents' chat completions over one session's context, sent together (one round)."""
    res = SessionResult(session.index, time.perf_counter(), scheduled)
    res.agents = [AgentTiming(0, p.model, res.sent) for p in profiles[:spec.fanout]]
    await asyncio.gather(*[_chat_request(client, url, b, a, timeout_s)
                           for b, a in zip(chat_bodies(session, spec, profiles), res.agents)])
    if all(a.error is None for a in res.agents):
        res.done = max(a.start + a.e2e_s for a in res.agents)
        res.rounds_s = [res.done - res.sent]
    return res


async def open_loop(url: str, sessions: list[Session], spec: WorkloadSpec, arrivals: list[float],
                    timeout_s: float, send=None) -> tuple[list[SessionResult], float, float]:
    """Send session i at arrivals[i] (s after start) whatever the backlog; returns results, t0, t_end.
    ``send``: how a session is sent (default :func:`run_session`; e.g. :func:`run_chat_session`)."""
    import httpx

    send = send or run_session

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        t0 = time.perf_counter()

        async def one(i: int, at: float) -> SessionResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await send(client, url, sessions[i], spec, t0 + at, timeout_s)

        results = await asyncio.gather(*[one(i, at) for i, at in enumerate(arrivals)])
        return list(results), t0, time.perf_counter()


async def closed_loop(url: str, sessions: list[Session], spec: WorkloadSpec, concurrency: int, duration_s: float,
                      timeout_s: float, send=None) -> tuple[list[SessionResult], float, float]:
    """``concurrency`` users, each sending its next session when the previous one ends, for ``duration_s``."""
    import httpx

    send = send or run_session
    results: list[SessionResult] = []
    it = iter(sessions)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1024), timeout=timeout_s) as client:
        t0 = time.perf_counter()

        async def user() -> None:
            while time.perf_counter() - t0 < duration_s:
                s = next(it, None)
                if s is None:
                    return
                results.append(await send(client, url, s, spec, time.perf_counter(), timeout_s))

        await asyncio.gather(*[user() for _ in range(concurrency)])
        return results, t0, time.perf_counter()
