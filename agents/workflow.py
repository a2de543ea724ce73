"""Declarative agents and workflows: what to run, separate from how it is sent.

An `Agent` is a decoder model plus an instruction template and sampling; a `Workflow` is a
list of rounds (each a set of agents that run concurrently over the same context) and a rule
for how a round's outputs join the context of the next. With `Join.SERVER` (or `Join.NONE`)
the whole workflow is one request and the app joins outputs itself; a Python callable joins
on the client, one request per round, for formats the server does not offer.
"""
from __future__ import annotations

import enum
import json
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prefillshare.app.sampling import Sampling as _Sampling
from prefillshare.app.sampling import SamplingError

from .errors import WorkflowError
from .types import AgentResult

# The config's name rule (prefillshare.app.config): letters of any script, digits, '_', '.', '-'.
_NAME = re.compile(r"^[^\W_][\w.\-]{0,62}$")


@dataclass(frozen=True)
class Sampling(_Sampling):
    """The app's one sampling type (app/sampling.py), with the SDK's error type: what an agent
    may ask for (stop, n, logprobs, penalties, logit_bias, a JSON schema via
    ``structured=StructuredOutput.for_schema(...)``) is checked here, before anything is sent."""

    def __post_init__(self):
        try:
            super().__post_init__()
        except SamplingError as e:
            raise WorkflowError(f"sampling.{e}") from None

    def to_json(self) -> dict[str, Any]:
        """The agent-body fields of /v1/agents/run that differ from the server's defaults."""
        body: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        defaults = _Sampling()
        for name in ("seed", "top_k", "min_p", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "logprobs"):
            if getattr(self, name) != getattr(defaults, name):
                body[name] = getattr(self, name)
        if self.stop:
            body["stop"] = list(self.stop)
        if self.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        if self.structured is not None:
            body["response_format"] = (
                {"type": "json_object"} if self.structured.json_object else
                {"type": "json_schema", "json_schema": {"name": "output",
                                                        "schema": json.loads(self.structured.json_schema)}})
        return body


@dataclass(frozen=True)
class Agent:
    """One agent: `model` is the served decoder, `instruction` may hold `{placeholders}`."""

    model: str
    instruction: str
    name: str | None = None  # default: the model's name
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self):
        if not self.model:
            raise WorkflowError("agent.model is empty")
        label = self.name or self.model
        if not _NAME.match(label):
            raise WorkflowError(f"agent name {label!r}: use letters, digits, '_', '.', '-' (max 63)")
        if not self.instruction.strip():
            raise WorkflowError(f"agent {label}: instruction is empty")
        self.placeholders()  # a malformed template fails here, not at run time

    @property
    def label(self) -> str:
        return self.name or self.model

    def placeholders(self) -> set[str]:
        try:
            return {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(self.instruction) if f}
        except ValueError as e:
            raise WorkflowError(f"agent {self.label}: instruction template: {e}") from None

    def render(self, variables: Mapping[str, Any] | None = None) -> Agent:
        """This agent with its instruction's placeholders filled in."""
        variables = dict(variables or {})
        missing = self.placeholders() - set(variables)
        if missing:
            raise WorkflowError(f"agent {self.label}: instruction needs variables {sorted(missing)}")
        if not self.placeholders():
            return self
        return replace(self, instruction=self.instruction.format_map(variables))

    def to_json(self) -> dict[str, Any]:
        if self.placeholders():
            raise WorkflowError(f"agent {self.label}: unfilled placeholders {sorted(self.placeholders())}")
        return {"name": self.label, "model": self.model, "instruction": self.instruction, **self.sampling.to_json()}


class Join(enum.Enum):
    SERVER = "server"  # the app appends `name:text` lines of a round to the context
    NONE = "none"  # every round sees the original context


JoinFn = Callable[[str, Sequence[AgentResult]], str]


@dataclass(frozen=True)
class Workflow:
    rounds: tuple[tuple[Agent, ...], ...]
    join: Join | JoinFn = Join.SERVER

    def __post_init__(self):
        rounds = tuple(tuple(r) for r in self.rounds)
        object.__setattr__(self, "rounds", rounds)
        if not rounds:
            raise WorkflowError("workflow has no rounds")
        for i, r in enumerate(rounds):
            if not r:
                raise WorkflowError(f"round {i} has no agents")
            labels = [a.label for a in r]
            dup = sorted({n for n in labels if labels.count(n) > 1})
            if dup:
                raise WorkflowError(f"round {i}: agent names {dup} repeat; give each a distinct name")
        if not isinstance(self.join, Join) and not callable(self.join):
            raise WorkflowError("join: use Join.SERVER, Join.NONE or a function (context, results) -> context")

    @classmethod
    def fan_out(cls, *agents: Agent) -> Workflow:
        """One round: every agent over the same context."""
        return cls((tuple(agents),))

    @classmethod
    def pipeline(cls, *rounds: Sequence[Agent] | Agent, join: Join | JoinFn = Join.SERVER) -> Workflow:
        """Rounds in order, e.g. planner -> [workers] -> aggregator."""
        return cls(tuple((r,) if isinstance(r, Agent) else tuple(r) for r in rounds), join)

    @property
    def server_side(self) -> bool:
        return isinstance(self.join, Join)

    def rendered(self, variables: Mapping[str, Any] | None = None) -> tuple[tuple[Agent, ...], ...]:
        """Rounds with templates filled; `round` (0-based) is always available."""
        return tuple(tuple(a.render({**(variables or {}), "round": i}) for a in r) for i, r in enumerate(self.rounds))


def join_lines(context: str, results: Sequence[AgentResult]) -> str:
    """The server's join, as a client-side function (a starting point for custom joins)."""
    joined = "\n".join(f"{r.name}:{r.text.strip()}" for r in results if r.ok)
    return f"{context}\n{joined}" if joined else context
