"""The transformers reference of "decode from a shared base KV" (the oracle of the vLLM path)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from random_checkpoint import save_random_model

from prefillshare.app.models.checkpoint import load_model
from prefillshare.app.prompt_split import split_prompt
from prefillshare.app.reference import (
    batched_greedy_from_kv,
    batched_prompt_kv,
    prompt_kv,
    shared_greedy,
)
from prefillshare.app.training import tasks
from prefillshare.app.training.tokenizer import load_tokenizer

TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "tokenizer"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    base = load_model(save_random_model(root / "base", TOKENIZER, seed=1))
    other = load_model(save_random_model(root / "other", TOKENIZER, seed=2))
    return base, other


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(TOKENIZER)
    return [tok(e.prompt)["input_ids"] for e in tasks.make_examples(3, seed=7)[:5]]


def test_decoder_identical_to_base_reproduces_base_greedy_tokens(models, prompts):
    base, _ = models
    twin = copy.deepcopy(base)
    for p in prompts:
        # an independent oracle: transformers' own generate over the whole prompt
        want = base.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=12, min_new_tokens=12, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert shared_greedy(base, twin, p, 12) == want


def test_other_decoder_on_base_kv_is_not_private_prefill(models, prompts):
    """The hand-over is real: a decoder fed the base's KV differs from it prefilling privately."""
    base, other = models
    diffs = [shared_greedy(base, other, p, 8) != shared_greedy(other, other, p, 8) for p in prompts]
    assert any(diffs)


def test_batched_shared_greedy_equals_one_by_one(models, prompts):
    base, other = models
    assert len({len(p) for p in prompts}) > 1  # padding is exercised
    splits = [split_prompt(p) for p in prompts]  # the hand-over per prompt, as the engines make it
    batched = batched_greedy_from_kv(other, batched_prompt_kv(base, [s for s, _ in splits]), [o for _, o in splits], 10)
    assert batched == [shared_greedy(base, other, p, 10) for p in prompts]


def test_padded_prefix_kv_matches_unpadded(models, prompts):
    base, _ = models
    kv = batched_prompt_kv(base, prompts)
    for i, p in enumerate(prompts):
        alone = prompt_kv(base, p)
        for a, b in zip(kv.cache.layers, alone.layers):
            width = a.keys.shape[2]  # left-padded: row i's tokens are the last len(p) slots
            torch.testing.assert_close(a.keys[i:i + 1, :, width - len(p):], b.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(a.values[i:i + 1, :, width - len(p):], b.values, rtol=1e-4, atol=1e-5)
