"""The synthetic multi-agent task suite: shared order records, one task per agent.

Every context is one order record written as ``field: value`` lines plus a free-text note.
Each field draws its values from a vocabulary of its own (no word is a value of two fields),
so finding "the city" in a context is ONE attention hop (attend to the token that is a city),
which a 1-2M-parameter Llama learns in a few hundred steps; plain key/value retrieval needs
an induction circuit and plateaus for thousands of steps (see docs/platform.md).

All agents answer on the same contexts, so their prompts share the context prefix. The text
template of a prompt is defined here once (:func:`render_prompt`); the Serve app uses it.
"""
from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from prefillshare.app.errors import PrefillShareLibraryError

FIELDS: dict[str, tuple[str, ...]] = {
    "name": ("maya", "omar", "lena", "ivan", "sara", "noah", "mila", "theo", "zara", "hugo",
             "nina", "igor", "rosa", "finn", "ada", "leo", "yuki", "ravi", "elsa", "karl"),
    "city": ("oslo", "rome", "lima", "kyiv", "doha", "bern", "riga", "nice", "perth", "quito",
             "cairo", "dakar", "hanoi", "porto", "turin", "malmo", "accra", "davao", "izmir", "sendai"),
    "item": ("lamp", "desk", "sofa", "chair", "rug", "clock", "mirror", "shelf", "bed", "stool",
             "vase", "fan", "kettle", "radio", "camera", "bike", "tent", "drum", "guitar", "piano"),
    "qty": ("1", "2", "3", "4", "5", "6", "7", "8", "9"),
    "day": ("mon", "tue", "wed", "thu", "fri", "sat", "sun"),
    "color": ("red", "blue", "green", "black", "white", "pink", "gray", "gold", "teal", "navy"),
    "status": ("open", "paid", "late", "held", "sent"),
}
REQUIRED_FIELDS = ("item", "qty", "city", "day")
NOTE_WORDS = ("please", "call", "before", "noon", "thanks", "fragile", "leave", "at", "door",
              "gift", "wrap", "urgent", "back", "gate", "ring", "twice", "no", "rush", "side",
              "entrance", "keep", "dry", "handle", "with", "care", "early", "morning")
NEXT_DAY = {d: FIELDS["day"][(i + 1) % 7] for i, d in enumerate(FIELDS["day"])}
HUBS = ("north", "south", "east", "west")
HUB = {c: HUBS[i % len(HUBS)] for i, c in enumerate(FIELDS["city"])}  # which hub ships to a city


# --- the prompt template: the single definition used by training, eval and serving ---
def render_prompt(context: str, instruction: str) -> str:
    """Prompt text of one agent request: the shared context, then the agent's instruction.

    Instructions end with a line naming a field (``...\ncity``): that last token is the one the
    decoder runs itself (app/prompt_split.py), and a field name on its own line is where the base
    learned to look the field's value up, so the decoder starts from a working lookup.
    """
    return f"{context}\n{instruction}"


def render_response(answer: str) -> str:
    """Text the model generates after the prompt (eos is appended as a token, not text).

    A leading space: values are written " value" everywhere (context lines, instructions,
    tool calls), so a value is the same single token wherever it appears.
    """
    return f" {answer}"


def parse_response(text: str) -> str:
    """Answer string from generated text (what exact match compares)."""
    return text.strip()


@dataclass(frozen=True)
class Example:
    """One JSONL record of the suite."""

    agent: str
    context: str
    instruction: str
    answer: str

    @property
    def prompt(self) -> str:
        return render_prompt(self.context, self.instruction)


# --- contexts ---
@dataclass(frozen=True)
class Record:
    fields: tuple[tuple[str, str], ...]  # (field, value) in context order
    note: tuple[str, ...]

    def value(self, field: str) -> str | None:
        return dict(self.fields).get(field)

    def text(self) -> str:
        lines = [f"{f}: {v}" for f, v in self.fields]
        lines.append("note: " + " ".join(self.note))
        return "order\n" + "\n".join(lines)


def sample_record(rng: random.Random) -> Record:
    optional = [f for f in FIELDS if f not in REQUIRED_FIELDS]
    chosen = list(REQUIRED_FIELDS) + rng.sample(optional, rng.randint(0, len(optional)))
    rng.shuffle(chosen)
    fields = tuple((f, rng.choice(FIELDS[f])) for f in chosen)
    note = tuple(rng.choice(NOTE_WORDS) for _ in range(rng.randint(1, 8)))
    return Record(fields, note)


# --- agents: each a different task on the same record ---
def _lookup(rec: Record, rng: random.Random) -> tuple[str, str]:
    field, value = rng.choice(rec.fields)
    return f"Q: what is the\n{field}", value


def _tool_call(rec: Record, rng: random.Random) -> tuple[str, str]:
    call = f"ship --item {rec.value('item')} --qty {rec.value('qty')} --city {rec.value('city')}"
    return "Q: call the shipping tool.\ntool", call


def _reschedule(rec: Record, rng: random.Random) -> tuple[str, str]:
    return "Q: move the delivery one day later. which\nday", NEXT_DAY[rec.value("day") or "mon"]


def _route(rec: Record, rng: random.Random) -> tuple[str, str]:
    return "Q: which hub ships to the\ncity", HUB[rec.value("city") or "oslo"]


AGENTS = {
    "lookup": _lookup,          # retrieve the value of a named field
    "tool_call": _tool_call,    # emit a command-line tool call built from three fields
    "reschedule": _reschedule,  # retrieve the day, then map it to the next day
    "route": _route,            # retrieve the city, then classify it into one of four hubs
}


def make_examples(num_contexts: int, seed: int, agents: Iterable[str] = tuple(AGENTS)) -> list[Example]:
    """``num_contexts`` records, every agent asked on each (the shared-context setting)."""
    agents = list(agents)
    for a in agents:
        if a not in AGENTS:
            raise ValueError(f"unknown agent {a!r}; known: {', '.join(AGENTS)}")
    rng = random.Random(seed)
    out = []
    for i in range(num_contexts):
        rec = sample_record(rng)
        ctx = rec.text()
        for a in agents:
            # each agent draws from a stream of its own: records stay the same whichever agents run
            instruction, answer = AGENTS[a](rec, random.Random(f"{seed}/{i}/{a}"))
            out.append(Example(a, ctx, instruction, answer))
    return out


def split_examples(examples: list[Example], test_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Seeded train/test split by context, so no test context was seen in training."""
    contexts = sorted({e.context for e in examples})
    random.Random(seed).shuffle(contexts)
    test_ctx = set(contexts[: round(len(contexts) * test_fraction)])
    train = [e for e in examples if e.context not in test_ctx]
    test = [e for e in examples if e.context in test_ctx]
    return train, test


# --- base pretraining text: records followed by dense field queries ---
def pretrain_text(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """One pretraining document and its (query prefix, answer) pairs, for the retrieval gate.

    The base learns the record language and one-hop lookup (``city? oslo``) in a format of its
    own; the agents' instruction formats are left to the decoders' fine-tuning.
    """
    rec = sample_record(rng)
    fields = list(rec.fields)
    rng.shuffle(fields)
    text = rec.text() + "\n"
    pairs = []
    for f, v in fields:
        pairs.append((text + f, f" {v}"))
        text += f"{f} {v}\n"
    return text, pairs


# --- JSONL I/O with errors that name the file and line ---
class DataError(PrefillShareLibraryError, ValueError):
    """A data file is malformed: the message names the file, the line and the problem."""


REQUIRED_KEYS = ("agent", "context", "instruction", "answer")


def jsonl_objects(path: str | os.PathLike) -> Iterator[tuple[str, int, dict]]:
    """(``path:line``, line number, object) for each non-blank line of a JSONL file; a missing
    file, a line that is not JSON or not an object raises :class:`DataError` naming the line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, lineno, obj


def read_jsonl(path: str | os.PathLike, known_agents: Iterable[str] | None = None) -> list[Example]:
    """Parse a suite file; every problem raises :class:`DataError` naming ``path:line``."""
    known = set(known_agents) if known_agents is not None else None
    out = []
    for where, _, obj in jsonl_objects(path):
        for k in REQUIRED_KEYS:
            if k not in obj:
                raise DataError(f"{where}: missing field {k!r}")
            if not isinstance(obj[k], str):
                raise DataError(f"{where}: field {k!r} must be a string")
        if known is not None and obj["agent"] not in known:
            raise DataError(f"{where}: unknown agent {obj['agent']!r}; known: {', '.join(sorted(known))}")
        out.append(Example(obj["agent"], obj["context"], obj["instruction"], obj["answer"]))
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def write_jsonl(path: str | os.PathLike, examples: Iterable[Example]) -> None:
    """Write atomically (temp file + rename): a failure leaves no half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for e in examples:
            fh.write(json.dumps(asdict(e)) + "\n")
    os.replace(tmp, path)


def iter_agents(examples: Iterable[Example]) -> Iterator[str]:
    """Agents in first-seen order."""
    seen: dict[str, None] = {}
    for e in examples:
        seen.setdefault(e.agent, None)
    return iter(seen)
