"""Seeded multi-agent workload for `python -m bench serve`.

A session is one `/v1/agents/run` call: a fresh shared context of about L tokens, N agents per
round (each a different decoder with a short instruction, O output tokens), R rounds whose
outputs the app joins into the next round's context. Sessions arrive as a Poisson process at
rate lambda (open loop, so queueing shows up in latency) or at a fixed concurrency (closed
loop). Every session of a run is derived from (seed, index), so every system sees the same
contexts and instructions in the same order.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# syllables for pronounceable filler words: BPE merges make them 1-3 tokens each, like text
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "ul", "an", "er", "is", "or", "en",
              "ta", "be", "co", "fu", "gi", "ha", "jo", "ly", "ma", "ni", "qu", "ro", "su", "we", "xa", "zo")
_VERBS = ("summarize", "check", "extract", "rewrite", "verify", "count", "classify", "plan", "list", "route")


def point_label(fanout: int, context_tokens: int, rounds: int) -> str:
    """How a point's shape is named in logs, tables and comparisons."""
    return f"N={fanout} L={context_tokens} R={rounds}"


@dataclass(frozen=True)
class WorkloadSpec:
    """One point's shape: context tokens, fan-out, output tokens, rounds."""

    context_tokens: int = 1024       # L
    fanout: int = 2                  # N agents (decoders) per round
    output_tokens: int = 32          # O per agent
    rounds: int = 1                  # R
    instruction_words: int = 6

    def __post_init__(self) -> None:
        if self.context_tokens < 16:
            raise ValueError("--lengths: context length must be >= 16 tokens")
        if self.fanout < 1:
            raise ValueError("--fanouts: fan-out must be >= 1")
        if self.output_tokens < 1:
            raise ValueError("--output-tokens must be >= 1")
        if self.rounds < 1:
            raise ValueError("--rounds must be >= 1")

    @property
    def label(self) -> str:
        return point_label(self.fanout, self.context_tokens, self.rounds)


@dataclass(frozen=True)
class Session:
    index: int
    context: str
    instructions: tuple[str, ...]  # one per agent, reused every round


class ContextMaker:
    """Filler text cut to a token budget with the project tokenizer (what the app tokenizes with)."""

    def __init__(self, tokenizer_path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def _word(self, rng: random.Random) -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))

    def _record(self, rng: random.Random) -> str:
        return f"{self._word(rng)}: " + " ".join(self._word(rng) for _ in range(rng.randint(3, 8)))

    def _sentence(self, rng: random.Random) -> str:
        return " ".join(self._word(rng) for _ in range(rng.randint(6, 14))).capitalize() + "."

    def _fill(self, n_tokens: int, rng: random.Random, part, sep: str) -> str:
        """``part(rng)`` pieces joined by ``sep``, trimmed to at most ``n_tokens`` tokens."""
        parts: list[str] = []
        total = 0
        while total < n_tokens:
            parts.append(part(rng))
            total += self.count(parts[-1]) + 1
        ids = self.tok(sep.join(parts), add_special_tokens=False)["input_ids"][:n_tokens]
        return self.tok.decode(ids).strip()

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """Lines of `key: words` records, trimmed to at most ``n_tokens`` tokens."""
        return self._fill(n_tokens, rng, self._record, "\n")

    def prose(self, n_tokens: int, rng: random.Random) -> str:
        """Sentences of filler words, trimmed to at most ``n_tokens`` tokens."""
        return self._fill(n_tokens, rng, self._sentence, " ")


def make_sessions(spec: WorkloadSpec, count: int, seed: int | str, maker: ContextMaker) -> list[Session]:
    """``count`` sessions; session i depends only on (seed, spec, i)."""
    out = []
    for i in range(count):
        rng = random.Random(f"{seed}-{spec.context_tokens}-{spec.fanout}-{i}")
        context = f"session {seed}-{i}\n" + maker.text(spec.context_tokens - 8, rng)
        instr = tuple(
            f"agent {a}: {rng.choice(_VERBS)} " + " ".join(maker._word(rng) for _ in range(spec.instruction_words - 2))
            for a in range(spec.fanout))
        out.append(Session(i, context, instr))
    return out


@dataclass(frozen=True)
class AgentProfile:
    """One agent as a framework defines it (``--driver chat``): the decoder it calls, its own system
    prompt and its OpenAI ``tools``, the same in every session (only the shared context changes)."""

    model: str
    system: str
    tools: tuple[dict, ...]


def _tool(maker: ContextMaker, rng: random.Random, k: int) -> dict:
    """An OpenAI function tool: a verb_noun name (``k`` keeps an agent's names apart), a one-line
    description and 2-3 string parameters, described."""
    params = {maker._word(rng): {"type": "string", "description": maker.prose(rng.randint(4, 10), rng)}
              for _ in range(rng.randint(2, 3))}
    return {"type": "function", "function": {
        "name": f"{rng.choice(_VERBS)}_{maker._word(rng)}_{k}", "description": maker.prose(rng.randint(10, 20), rng),
        "parameters": {"type": "object", "properties": params, "required": list(params)}}}


def agent_profiles(models: list[str], seed: int | str, maker: ContextMaker, system_tokens: tuple[int, int] = (200, 500),
                   tools: int = 2) -> list[AgentProfile]:
    """One profile per model: a system prompt of ``system_tokens`` (min, max) tokens (seeded, its length
    drawn per agent; it opens with the agent's name, so no two agents' prompts start alike) and
    ``tools`` tools of its own."""
    lo, hi = system_tokens
    if not 1 <= lo <= hi:
        raise ValueError("--system-tokens: give MIN,MAX with 1 <= MIN <= MAX")
    if tools < 0:
        raise ValueError("--agent-tools must be >= 0")
    out = []
    for i, model in enumerate(models):
        rng = random.Random(f"agent-{seed}-{i}")
        head = f"You are {model}, the agent that will {rng.choice(_VERBS)} what the conversation needs."
        body = maker.prose(max(1, rng.randint(lo, hi) - maker.count(head) - 1), rng)
        out.append(AgentProfile(model, f"{head} {body}", tuple(_tool(maker, rng, k) for k in range(tools))))
    return out


def poisson_arrivals(rate: float, duration_s: float, seed: int, max_sessions: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process at ``rate`` per second within ``duration_s``."""
    if rate <= 0:
        raise ValueError("--rates: arrival rates must be > 0 sessions/s")
    rng = random.Random(f"arrivals-{seed}-{rate}")
    t, out = 0.0, []
    while len(out) < max_sessions:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        out.append(t)
    return out or [0.0]
