"""The one hand-over convention between a prefill module and a decode module.

The frozen base computes the KV of every prompt token but the last; the decoder runs the
last prompt token itself and then generates. Training, the transformers reference and the
vLLM connector all split prompts with :func:`split_prompt`, so the served decoder sees the
same mix of base and own KV that it was trained on.
"""
from __future__ import annotations

from collections.abc import Sequence


def shared_length(num_prompt_tokens: int) -> int:
    """How many leading prompt tokens the prefill module's KV covers."""
    if num_prompt_tokens < 1:
        raise ValueError("a prompt needs at least one token")
    return num_prompt_tokens - 1


def split_prompt(token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(tokens whose KV comes from the prefill module, tokens the decoder runs itself)."""
    n = shared_length(len(token_ids))
    return list(token_ids[:n]), list(token_ids[n:])
