"""Typed results of the SDK: what one agent produced, what a run cost, and stream events.

Parsed from the app's JSON (POST /v1/agents/run, its event stream, the OpenAI routes) in one
place so the sync and async clients agree. Timings are measured by the client (wall clock
from sending the request) unless the server reports its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import AgentFailedError


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV the decoder loaded instead of computing


@dataclass(frozen=True)
class PrefillInfo:
    """Which shared prefill module (and replica) computed this agent's prompt KV."""

    module: str
    replica: str | None = None


@dataclass(frozen=True)
class Timings:
    ttft_s: float | None = None  # first text of this agent (streaming), from request start
    total_s: float | None = None  # this agent finished, from request start


@dataclass(frozen=True)
class AgentChoice:
    """One of an agent's sequences when it asked for ``n`` > 1 or ``logprobs``."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # OpenAI's chat shape: {"content": [{token, logprob, top_logprobs}]}


@dataclass(frozen=True)
class AgentResult:
    round: int
    name: str
    model: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    error: str | None
    usage: Usage
    prefill: PrefillInfo | None
    timings: Timings = field(default_factory=Timings)
    choices: tuple[AgentChoice, ...] = ()  # every sequence (n > 1 or logprobs); text is the first one's
    error_code: str | None = None  # the server's typed code for `error` (docs/serving.md)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def shared_prefill(self) -> bool:
        """True when the decoder started from KV a shared prefill module computed."""
        return self.prefill is not None and self.usage.cached_tokens > 0


@dataclass(frozen=True)
class RunUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    shared_prefix_tokens: int = 0  # tokens of context common to a round's agents
    prefill_tokens_computed: int = 0  # tokens the shared prefill modules actually computed

    @property
    def prompt_tokens_saved(self) -> int:
        """Decoder prompt tokens not recomputed because their KV came from the shared prefill."""
        return self.cached_tokens

    @property
    def saved_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def __add__(self, other: RunUsage) -> RunUsage:
        return RunUsage(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class RunResult:
    id: str
    results: tuple[AgentResult, ...]
    usage: RunUsage
    final_context: str
    elapsed_s: float

    @property
    def rounds(self) -> list[list[AgentResult]]:
        out: dict[int, list[AgentResult]] = {}
        for r in self.results:
            out.setdefault(r.round, []).append(r)
        return [out[k] for k in sorted(out)]

    def agent(self, name: str, round: int | None = None) -> AgentResult:
        """The named agent's result in `round` (default: the last round it ran in)."""
        hits = [r for r in self.results if r.name == name and (round is None or r.round == round)]
        if not hits:
            raise KeyError(f"no agent {name!r}" + (f" in round {round}" if round is not None else ""))
        return hits[-1]

    def __getitem__(self, name: str) -> AgentResult:
        return self.agent(name)

    @property
    def texts(self) -> dict[str, str]:
        """Last round's text per agent name."""
        return {r.name: r.text for r in self.rounds[-1]} if self.results else {}

    @property
    def failures(self) -> tuple[AgentResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    def raise_for_errors(self) -> RunResult:
        if self.failures:
            raise AgentFailedError(self.failures)
        return self


@dataclass(frozen=True)
class AgentDelta:
    round: int
    agent: str
    model: str
    text: str
    elapsed_s: float


@dataclass(frozen=True)
class AgentDone:
    round: int
    result: AgentResult


@dataclass(frozen=True)
class RoundDone:
    round: int
    results: tuple[AgentResult, ...]


@dataclass(frozen=True)
class RunDone:
    result: RunResult


RunEvent = AgentDelta | AgentDone | RoundDone | RunDone


@dataclass(frozen=True)
class ModelInfo:
    id: str
    prefill_module: str | None  # None: this decoder prefills privately
    private_prefill_reason: str | None = None


@dataclass(frozen=True)
class Completion:
    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage
    elapsed_s: float


@dataclass(frozen=True)
class Readiness:
    ready: bool
    problems: tuple[str, ...] = ()
    engines: int | None = None
    asleep: tuple[str, ...] = ()  # decoders their autoscaler stopped (min_replicas: 0): the next request starts one


# ---- parsing -----------------------------------------------------------------------------

def one_line(text: str) -> str:
    """An answer as one terminal line: a newline, carriage return or other control character
    would otherwise split or overwrite what a log or example prints."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text.strip())


def _int(d: dict, key: str) -> int:
    v = d.get(key)
    return int(v) if isinstance(v, (int, float)) else 0


def parse_agent_result(d: dict[str, Any], timings: Timings | None = None) -> AgentResult:
    usage = d.get("usage") or {}
    prefill = d.get("prefill")
    server_t = Timings(d.get("ttft_s"), d.get("e2e_s")) if ("ttft_s" in d or "e2e_s" in d) else None
    return AgentResult(
        round=int(d.get("round", 0)),
        name=str(d.get("name") or d.get("model") or ""),
        model=str(d.get("model", "")),
        text=str(d.get("text") or ""),
        token_ids=tuple(d.get("token_ids") or ()),
        finish_reason=d.get("finish_reason"),
        error=d.get("error"),
        usage=Usage(_int(usage, "prompt_tokens"), _int(usage, "completion_tokens"), _int(usage, "cached_tokens")),
        prefill=PrefillInfo(str(prefill.get("module")), prefill.get("replica")) if isinstance(prefill, dict) else None,
        timings=server_t or timings or Timings(),
        choices=tuple(AgentChoice(int(c.get("index", 0)), str(c.get("text") or ""), tuple(c.get("token_ids") or ()),
                                  c.get("finish_reason"), c.get("logprobs")) for c in d.get("choices") or ()),
        error_code=d.get("error_code"),
    )


def parse_run_usage(d: dict[str, Any] | None) -> RunUsage:
    d = d or {}
    return RunUsage(*(_int(d, f) for f in RunUsage.__dataclass_fields__))


def parse_run(d: dict[str, Any], elapsed_s: float, timings: dict[tuple[int, str], Timings] | None = None) -> RunResult:
    timings = timings or {}
    results = tuple(
        parse_agent_result(r, timings.get((int(r.get("round", 0)), str(r.get("name") or r.get("model") or ""))))
        for r in d.get("results") or []
    )
    return RunResult(
        id=str(d.get("id", "")),
        results=results,
        usage=parse_run_usage(d.get("usage")),
        final_context=str(d.get("final_context") or ""),
        elapsed_s=elapsed_s,
    )
