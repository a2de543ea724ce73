"""Token-level examples, the padded batch, and the two losses on it: shared prefill and private prefill.

A batch holds each example's prefix (prompt[:-1], the base's part under app/prompt_split.py)
LEFT-padded and its own tokens (prompt[-1] + response[:-1]) right-padded, so every row's real
tokens are contiguous: attention windows measured in cache slots (sliding-window models)
see the same neighbours as the unpadded example, and positions come from the mask. A padded
batch computes exactly what each example computes alone (tests/test_training.py checks it).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from prefillshare.app.prompt_split import HANDOVER, Activation, split_prompt
from prefillshare.app.rendering import Renderer
from prefillshare.app.training import tasks


@dataclass(frozen=True)
class Encoded:
    agent: str
    prompt: tuple[int, ...]    # as the tokenizer/renderer made it (BOS included when it adds one)
    response: tuple[int, ...]  # answer tokens, ending in eos


def encode(tokenizer, examples: Sequence[tasks.Example], renderer: Renderer | None = None) -> list[Encoded]:
    """Suite examples rendered as ``renderer`` renders an agent request (default: the plain suite
    rendering ``context\\ninstruction``), so training, evaluation and serving make the same ids."""
    renderer = renderer or Renderer()
    out = []
    for e in examples:
        prompt, response = renderer.training_ids(
            tokenizer, [*renderer.agent_messages(e.context, e.instruction), ("assistant", e.answer)])
        out.append(Encoded(e.agent, tuple(prompt), tuple(response)))
    return out


def pad_id_of(tokenizer) -> int:
    """Pads are masked out, so any id works; tokenizers without a pad token (Llama 3, Mistral) use eos."""
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if t is not None:
            return int(t)
    return 0


@dataclass
class Batch:
    prefix_ids: torch.Tensor   # [B, P] left-padded prompt[:-1]
    prefix_mask: torch.Tensor  # [B, P]
    own_ids: torch.Tensor      # [B, D] right-padded prompt[-1] + response[:-1]
    own_mask: torch.Tensor     # [B, D]
    labels: torch.Tensor       # [B, D] the token each own position predicts (response), -100 elsewhere

    def to(self, device) -> Batch:
        return Batch(*(t.to(device) for t in (self.prefix_ids, self.prefix_mask, self.own_ids, self.own_mask,
                                               self.labels)))

    def as_dict(self) -> dict[str, torch.Tensor]:
        # "shift_labels": the Trainer counts answer tokens across gradient accumulation from it
        return {"prefix_ids": self.prefix_ids, "prefix_mask": self.prefix_mask, "own_ids": self.own_ids,
                "own_mask": self.own_mask, "labels": self.labels, "shift_labels": self.labels}

    @classmethod
    def from_dict(cls, d: dict) -> Batch:
        return cls(d["prefix_ids"], d["prefix_mask"], d["own_ids"], d["own_mask"], d["labels"])


def collate(examples: Sequence[Encoded], pad_id: int, activation: Activation = HANDOVER) -> Batch:
    """Each prompt split where the decoder takes over: the hand-over point, or an Activated LoRA
    adapter's invocation (the base's KV before it, the adapter's tokens from it on)."""
    splits = [split_prompt(e.prompt, activation) for e in examples]
    own = [o + list(e.response[:-1]) for (_, o), e in zip(splits, examples)]
    b = len(examples)
    p_width = max(len(s) for s, _ in splits)
    d_width = max(len(o) for o in own)
    prefix_ids = torch.full((b, p_width), pad_id, dtype=torch.long)
    prefix_mask = torch.zeros((b, p_width), dtype=torch.long)
    own_ids = torch.full((b, d_width), pad_id, dtype=torch.long)
    own_mask = torch.zeros((b, d_width), dtype=torch.long)
    labels = torch.full((b, d_width), -100, dtype=torch.long)
    for i, ((shared, _), o, e) in enumerate(zip(splits, own, examples)):
        if shared:
            prefix_ids[i, p_width - len(shared):] = torch.tensor(shared)
            prefix_mask[i, p_width - len(shared):] = 1
        own_ids[i, : len(o)] = torch.tensor(o)
        own_mask[i, : len(o)] = 1
        labels[i, : len(e.response)] = torch.tensor(e.response)  # own[0] = prompt[-1] predicts response[0]
    return Batch(prefix_ids, prefix_mask, own_ids, own_mask, labels)


class FrozenPrefixLayer(DynamicLayer):
    """One layer of a read-only prefix KV: ``update`` returns prefix + new states and stores nothing.

    So one base KV feeds any number of decoder forwards (several methods, several decoders) and
    a gradient-checkpointed layer can run again in the backward pass and see the same cache.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@dataclass
class PrefixKV:
    """The base KV of a batch of left-padded prefixes."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor     # [B, P]
    lengths: torch.Tensor  # [B] real prefix lengths

    def cache(self) -> Cache:
        return Cache(layers=[FrozenPrefixLayer(k, v) for k, v in self.layers])


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position of each token counted over real tokens only (pads get 0; they are never attended)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def prefix_kv(model, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor) -> PrefixKV:
    """KV of ``model`` over left-padded prefixes, without gradients (the prefill module is frozen)."""
    lengths = prefix_mask.sum(1)
    if prefix_ids.shape[1] == 0:
        return PrefixKV([], prefix_mask, lengths)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=positions_from_mask(prefix_mask),
              past_key_values=cache, use_cache=True)
    return PrefixKV([(layer.keys, layer.values) for layer in cache.layers], prefix_mask, lengths)


def logits_on_prefix(decoder, kv: PrefixKV, own_ids: torch.Tensor, own_mask: torch.Tensor) -> torch.Tensor:
    """Logits of ``decoder`` over right-padded ``own_ids`` placed after each row's real prefix."""
    positions = kv.lengths[:, None] + torch.arange(own_ids.shape[1], device=own_ids.device)[None, :]
    mask = torch.cat([kv.mask, own_mask], dim=1)
    cache = kv.cache() if kv.layers else None
    return decoder(input_ids=own_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                   use_cache=cache is not None).logits


def per_example_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL per row [B], answer token count per row [B])."""
    labels = labels.to(logits.device)
    tok = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
    valid = labels != -100
    return (tok * valid).sum(1), valid.sum(1)


def shared_nll_batch(decoder, kv: PrefixKV, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache-conditioned teacher forcing on a given base KV; NLL of the response tokens only."""
    return per_example_nll(logits_on_prefix(decoder, kv, batch.own_ids, batch.own_mask), batch.labels)


def private_nll_batch(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Ordinary fine-tuning: the model prefills its own prompt; NLL of the response tokens only."""
    ids = torch.cat([batch.prefix_ids, batch.own_ids], 1)
    mask = torch.cat([batch.prefix_mask, batch.own_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    return per_example_nll(logits[:, batch.prefix_ids.shape[1]:], batch.labels)


# --- list-of-examples forms (evaluation, tests) ---
def _device_of(model):
    return next(model.parameters()).device


def shared_nll(base, decoder, examples: Sequence[Encoded], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Base KV of prompt[:-1] (no grad), decoder runs prompt[-1] + response[:-1] on it."""
    batch = collate(examples, pad_id).to(_device_of(decoder))
    return shared_nll_batch(decoder, prefix_kv(base, batch.prefix_ids, batch.prefix_mask), batch)


def private_nll(model, examples: Sequence[Encoded], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return private_nll_batch(model, collate(examples, pad_id).to(_device_of(model)))
