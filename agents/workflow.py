"""Declarative agents and workflows: what to run, separate from how it is sent.

An `Agent` is a decoder model plus an instruction template and sampling; a `Workflow` is a
list of rounds (each a set of agents that run concurrently over the same context) and a rule
for how a round's outputs join the context of the next. With `Join.SERVER` (or `Join.NONE`)
the whole workflow is one request and the app joins outputs itself; a Python callable joins
on the client, one request per round, for formats the server does not offer.
"""
from __future__ import annotations

import enum
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import WorkflowError
from .sampling import Sampling
from .types import AgentResult

# The config's name rule (prefillshare.app.config): letters of any script, digits, '_', '.', '-'.
_NAME = re.compile(r"^[^\W_][\w.\-]{0,62}$")


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
