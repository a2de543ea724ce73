"""Do a prefill module's decoders share its prefill? Checked once, when the plan is built.

PrefillShare saves prefill only where the agents' prompts start with the same tokens. Agent
frameworks send each agent's own system prompt first; a decoder trained system-first then
renders that text before the shared conversation and shares nothing with the others, with no
error anywhere. :func:`module_sharing` renders one probe request, as a framework sends it
(``[system: the agent's own text, user: a shared context]``), through every decoder of a module
with two different system prompts and counts what the two prompts share: a decoder whose
prompts part before the context is named, with the cause and the fix.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from prefillshare.app.prompt_split import split_prompt
from prefillshare.app.rendering import Renderer

PROBE_CONTEXT = ("order\ncity: porto\nday: wed\nstatus: open\nqty: 4\nitem: lamp\ncolor: red\nname: yuki\n"
                 "note: leave it at the side door at noon, the customer works late on wednesdays")
PROBE_SYSTEMS = ("You are the first probe agent. Answer from the record.",
                 "You are a second probe agent with other instructions. Count what the record holds.")
# a decoder shares when two agents' prompts share at least this part of the context's tokens (a
# byte-level BPE may merge the context's last token with what follows it)
SHARED_PART = 0.9


def common_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Longest token prefix shared by every prompt."""
    if not prompts:
        return []
    first = prompts[0]
    n = min(len(p) for p in prompts)
    i = 0
    while i < n and all(p[i] == first[i] for p in prompts):
        i += 1
    return list(first[:i])


def prefix_tree_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens a prefix cache computes for ``prompts``: each shared prefix once (the trie's nodes)."""
    ordered = sorted(tuple(p) for p in prompts)
    return sum(len(p) for p in ordered) - sum(len(common_prefix([a, b])) for a, b in zip(ordered, ordered[1:]))


def fanout_cost(prompts: Sequence[Sequence[int]]) -> tuple[int, float]:
    """(prompt tokens the base computes for a fan-out of ``prompts``, one prompt's handed-over tokens
    on average): each prompt but its last token (app/prompt_split.py), shared prefixes once."""
    handed = [split_prompt(p)[0] for p in prompts]
    return prefix_tree_tokens(handed), (sum(len(p) for p in handed) / len(handed) if handed else 0.0)


@dataclass(frozen=True)
class DecoderSharing:
    decoder: str
    layout: str
    shared_tokens: int  # tokens two agents' probe prompts share on this decoder
    context_tokens: int  # tokens of the probe context alone

    @property
    def shares(self) -> bool:
        return self.shared_tokens >= SHARED_PART * self.context_tokens

    @property
    def problem(self) -> str | None:
        """Why it shares nothing, and what to do; None when it shares."""
        if self.shares:
            return None
        return (f"decoder {self.decoder} (layout {self.layout}) renders an agent's own system prompt before the "
                f"shared context: two agents over one {self.context_tokens}-token context share "
                f"{self.shared_tokens} tokens, so the base prefills the context once per agent. Retrain it "
                "shared-first (`prefillshare train --layout shared-first`, the default); agent runs without a "
                "system prompt still share")


@dataclass(frozen=True)
class ModuleSharing:
    """What a fan-out of the probe to every decoder of one module costs the base."""

    module: str
    decoders: tuple[DecoderSharing, ...]
    fanout_tokens: int  # prompt tokens the base computes for the fan-out (shared prefixes once)
    prompt_tokens: float  # one agent's handed-over prompt, on average

    @property
    def ratio(self) -> float:
        """fanout_tokens / one prompt: 1.0 when every agent's own text is tiny, N when nothing is shared."""
        return self.fanout_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {"module": self.module, "fanout_tokens": self.fanout_tokens, "prompt_tokens": self.prompt_tokens,
                "ratio_to_one_prompt": round(self.ratio, 2),
                "decoders": [{**asdict(d), "shares": d.shares, "problem": d.problem} for d in self.decoders]}


def _probe(renderer: Renderer, tok, system: str) -> list[int]:
    return renderer.chat_ids(tok, [("system", system), ("user", PROBE_CONTEXT)])


def module_sharing(tok, module: str, renderers: Mapping[str, Renderer]) -> ModuleSharing:
    """The probe through each of ``renderers`` (served name -> Renderer, the module's decoders)."""
    context_tokens = len(tok(PROBE_CONTEXT, add_special_tokens=False)["input_ids"])
    decoders, fanout = [], []
    for i, (name, r) in enumerate(renderers.items()):
        a, b = _probe(r, tok, PROBE_SYSTEMS[0]), _probe(r, tok, PROBE_SYSTEMS[1])
        decoders.append(DecoderSharing(name, r.fmt.layout, len(common_prefix([a, b])), context_tokens))
        fanout.append(_probe(r, tok, f"{PROBE_SYSTEMS[i % 2]} You are agent {name}."))
    computed, one = fanout_cost(fanout)
    return ModuleSharing(module, tuple(decoders), computed, round(one, 1))
