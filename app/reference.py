"""Transformers oracle for "decode from a shared base KV".

Used by training and evaluation, and as the reference the vLLM path is tested against.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from app.handover import split_prompt


@torch.no_grad()
def prompt_kv(model: PreTrainedModel, token_ids: Sequence[int]) -> DynamicCache:
    """KV cache of ``model`` over ``token_ids`` (batch of one)."""
    cache = DynamicCache()
    if len(token_ids):
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def greedy_from_kv(
    decoder: PreTrainedModel,
    kv: DynamicCache,
    own_tokens: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy tokens of ``decoder`` continuing ``own_tokens`` on top of ``kv``.

    ``kv`` is copied, so one base KV can serve several decoders.
    """
    cache = copy.deepcopy(kv)
    ids = torch.tensor([list(own_tokens)], dtype=torch.long, device=decoder.device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = decoder(input_ids=ids, past_key_values=cache, use_cache=True).logits
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if eos_token_id is not None and nxt == eos_token_id:
            break
        ids = torch.tensor([[nxt]], dtype=torch.long, device=decoder.device)
    return out


def shared_greedy(
    base: PreTrainedModel,
    decoder: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """PrefillShare's served path, in transformers: base KV for the shared part, decoder for the rest."""
    shared, own = split_prompt(prompt_ids)
    return greedy_from_kv(decoder, prompt_kv(base, shared), own, max_new_tokens, eos_token_id)


def private_greedy(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """The ordinary path: the model prefills its own prompt."""
    return shared_greedy(model, model, prompt_ids, max_new_tokens, eos_token_id)
