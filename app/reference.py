"""Transformers oracle for "decode from a shared base KV".

Used by training and evaluation, and as the reference the vLLM path is tested against.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from prefillshare.app.prompt_split import split_prompt


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


# --- batched form of the same path (training and eval run many prompts at once) ---


@dataclass
class SharedKV:
    """Base KV of a batch of LEFT-padded prefixes: pads are masked out, never attended to, and
    every row's real tokens sit next to what follows them (sliding windows stay right)."""

    cache: DynamicCache
    mask: torch.Tensor     # [B, P] long, 1 = real token
    lengths: torch.Tensor  # [B] real prefix lengths


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T], mask [B, T]) with every sequence left-aligned."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T], mask [B, T]) with every sequence right-aligned."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def batched_prompt_kv(model: PreTrainedModel, prefixes: Sequence[Sequence[int]], pad_id: int = 0) -> SharedKV:
    """KV of ``model`` over each prefix (no gradients: the prefill module is frozen); positions
    count real tokens only, so a row's KV equals its unpadded KV."""
    ids, mask = pad_left(prefixes, pad_id, model.device)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
              past_key_values=cache, use_cache=True)
    return SharedKV(cache, mask, mask.sum(1))


def decode_on_kv(decoder: PreTrainedModel, kv: SharedKV, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits of ``decoder`` over right-padded ``ids`` [B, D] placed after each real prefix.

    Appends to ``kv.cache`` (callers that reuse a KV pass a copy). Each row's positions continue
    from its own prefix length, so padding never shifts RoPE positions.
    """
    positions = kv.lengths[:, None] + torch.arange(ids.shape[1], device=ids.device)[None, :]
    full_mask = torch.cat([kv.mask, mask], dim=1)
    return decoder(input_ids=ids, attention_mask=full_mask, position_ids=positions,
                   past_key_values=kv.cache, use_cache=True).logits


@torch.no_grad()
def batched_greedy_from_kv(
    decoder: PreTrainedModel,
    kv: SharedKV,
    own_tokens: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    pad_id: int = 0,
) -> list[list[int]]:
    """Batched :func:`greedy_from_kv`; ``kv`` is copied. Each row stops at its eos."""
    kv = SharedKV(copy.deepcopy(kv.cache), kv.mask.clone(), kv.lengths.clone())
    ids, mask = pad_right(own_tokens, pad_id, decoder.device)
    logits = decode_on_kv(decoder, kv, ids, mask)
    last = mask.sum(1) - 1
    nxt = logits[torch.arange(len(own_tokens)), last].argmax(-1)
    # later steps sit after the padded own block: positions continue from each row's real end
    kv = SharedKV(kv.cache, torch.cat([kv.mask, mask], 1), kv.lengths + mask.sum(1))
    out: list[list[int]] = [[] for _ in own_tokens]
    done = [False] * len(own_tokens)
    for step in range(max_new_tokens):
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = eos_token_id is not None and t == eos_token_id
        if all(done) or step == max_new_tokens - 1:
            break
        one = torch.ones((len(out), 1), dtype=torch.long, device=decoder.device)
        logits = decode_on_kv(decoder, kv, nxt[:, None], one)
        kv = SharedKV(kv.cache, torch.cat([kv.mask, one], 1), kv.lengths + 1)
        nxt = logits[:, -1].argmax(-1)
    return out
