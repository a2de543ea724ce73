"""The one hand-over convention between a prefill module and a decode module, and where an adapter acts.

The frozen base computes the KV of every prompt token but the last; the decoder runs the
last prompt token itself and then generates. Training, the transformers reference and the
vLLM connector all split prompts with :func:`split_prompt`, so the served decoder sees the
same mix of base and own KV that it was trained on.

An adapter's activation point generalizes that split (:class:`Activation`): the project's
cache-conditioned adapters act from the hand-over point, the last prompt token; PEFT's Activated
LoRA adapters (``alora_invocation_tokens`` in adapter_config.json) act from the start of the last
occurrence of their invocation sequence in the prompt, as PEFT's own ``generate()`` does, and a
prompt without it gets no adapter at all, which the engine refuses instead
(:class:`InvocationMissing`). Before the point a token is the base's, so every prefix-cache block
wholly before it is the base's (app/engine/vllm_plugin.py).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefillshare.app.errors import PrefillShareLibraryError

__all__ = ["Activation", "InvocationMissing", "last_occurrence", "shared_length", "split_prompt"]


def shared_length(num_prompt_tokens: int) -> int:
    """How many leading prompt tokens the prefill module's KV covers."""
    if num_prompt_tokens < 1:
        raise ValueError("a prompt needs at least one token")
    return num_prompt_tokens - 1


class InvocationMissing(PrefillShareLibraryError, ValueError):
    """An Activated LoRA adapter's prompt lacks its invocation sequence (PEFT would not run it at all)."""


def last_occurrence(tokens: Sequence[int] | np.ndarray, pattern: Sequence[int]) -> int | None:
    """The start of the last occurrence of ``pattern`` in ``tokens``, or None."""
    arr = np.asarray(tokens, dtype=np.int64)
    k = len(pattern)
    if k == 0 or arr.size < k:
        return None
    want = np.asarray(pattern, dtype=np.int64)
    for start in np.flatnonzero(arr[: arr.size - k + 1] == want[0])[::-1]:
        if np.array_equal(arr[start: start + k], want):
            return int(start)
    return None


@dataclass(frozen=True)
class Activation:
    """An adapter's activation rule: PEFT's invocation tokens, or none (the hand-over point)."""

    invocation_tokens: tuple[int, ...] = ()

    @classmethod
    def of_adapter(cls, path: str | Path) -> Activation:
        """The rule an adapter directory states (no adapter_config.json, or no invocation: the hand-over point)."""
        config = Path(path) / "adapter_config.json"
        if not config.is_file():
            return cls()
        tokens = json.loads(config.read_text()).get("alora_invocation_tokens") or ()
        return cls(tuple(int(t) for t in tokens))

    @property
    def is_alora(self) -> bool:
        return bool(self.invocation_tokens)

    def start(self, prompt: Sequence[int] | np.ndarray) -> int | None:
        """The first prompt position the adapter acts on; None: nowhere in this prompt (an aLoRA
        prompt without its invocation sequence)."""
        if not self.invocation_tokens:
            return shared_length(len(prompt))
        return last_occurrence(prompt, self.invocation_tokens)

    def check(self, model: str, prompt: Sequence[int]) -> None:
        """Refuse a prompt the adapter would not act on, naming the model and the sequence."""
        if self.is_alora and self.start(prompt) is None:
            raise InvocationMissing(
                f"model {model!r} is an Activated LoRA adapter: its prompt must contain its invocation "
                f"sequence {list(self.invocation_tokens)} (token ids; it acts from their last occurrence on)")


HANDOVER = Activation()


def split_prompt(token_ids: Sequence[int], activation: Activation = HANDOVER) -> tuple[list[int], list[int]]:
    """(tokens whose KV comes from the prefill module, tokens the decoder runs itself); an Activated
    LoRA prompt without its invocation raises :class:`InvocationMissing`."""
    n = activation.start(token_ids)
    if n is None:
        raise InvocationMissing(f"prompt: no invocation sequence {list(activation.invocation_tokens)} in it (an "
                                "Activated LoRA adapter acts from its last occurrence on)")
    return list(token_ids[:n]), list(token_ids[n:])
