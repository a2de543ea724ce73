"""Token-level examples and the two batch shapes: shared prefill and private prefill.

Both use right padding with masks and explicit positions, so a padded batch computes exactly
what each example computes alone (tests/test_training.py checks the losses agree).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from app.handover import split_prompt
from app.reference import SharedKV, batched_prompt_kv, decode_on_kv, pad_right
from app.training import tasks


@dataclass(frozen=True)
class Encoded:
    agent: str
    prompt: tuple[int, ...]    # starts with <s>
    response: tuple[int, ...]  # answer tokens then </s>


def encode(tokenizer, examples: Sequence[tasks.Example]) -> list[Encoded]:
    prompts = tokenizer([e.prompt for e in examples])["input_ids"]
    answers = tokenizer([tasks.render_response(e.answer) for e in examples], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [Encoded(e.agent, tuple(p), tuple(a) + (eos,)) for e, p, a in zip(examples, prompts, answers)]


def _labels(responses: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    labels = torch.full((len(responses), width), -100, dtype=torch.long)
    for i, r in enumerate(responses):
        labels[i, : len(r)] = torch.tensor(list(r))
    return labels


def _per_example_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL per row [B], answer token count per row [B])."""
    tok = F.cross_entropy(logits.float().transpose(1, 2), labels.to(logits.device), ignore_index=-100, reduction="none")
    valid = (labels != -100).to(tok.device)
    return (tok * valid).sum(1), valid.sum(1)


def nll_on_kv(decoder, kv: SharedKV, batch: Sequence[Encoded], own: Sequence[Sequence[int]],
              pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher forcing on a prefix KV: ``decoder`` runs its own prompt tokens + response[:-1]
    after the prefix; NLL of the response tokens only. ``kv`` is not modified."""
    kv = SharedKV(_clone_cache(kv.cache), kv.mask, kv.lengths)
    seqs = [list(o) + list(e.response[:-1]) for o, e in zip(own, batch)]
    ids, mask = pad_right(seqs, pad_id, decoder.device)
    logits = decode_on_kv(decoder, kv, ids, mask)
    # a row's first len(own) - 1 logits predict prompt tokens the decoder ran itself
    targets = [[-100] * (len(o) - 1) + list(e.response) for o, e in zip(own, batch)]
    return _per_example_nll(logits, _labels(targets, ids.shape[1]))


def _clone_cache(cache: DynamicCache) -> DynamicCache:
    return DynamicCache(ddp_cache_data=[(layer.keys, layer.values) for layer in cache.layers])


def shared_nll(base, decoder, batch: Sequence[Encoded], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache-conditioned teacher forcing: base KV of prompt[:-1] (no grad), decoder runs
    prompt[-1] + response[:-1] on it; NLL of the response tokens only."""
    splits = [split_prompt(e.prompt) for e in batch]
    kv = batched_prompt_kv(base, [s for s, _ in splits], pad_id)
    return nll_on_kv(decoder, kv, batch, [o for _, o in splits], pad_id)


def private_nll(model, batch: Sequence[Encoded], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ordinary fine-tuning: the model prefills its own prompt; NLL of the response tokens only."""
    seqs = [list(e.prompt) + list(e.response[:-1]) for e in batch]
    ids, mask = pad_right(seqs, pad_id, model.device)
    logits = model(input_ids=ids, attention_mask=mask).logits
    targets = [[-100] * (len(e.prompt) - 1) + list(e.response) for e in batch]
    return _per_example_nll(logits, _labels(targets, ids.shape[1]))
