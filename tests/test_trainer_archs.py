"""The cache-conditioned trainer on real architectures (random weights, small shapes, CPU).

Llama, Qwen2 (qkv bias, sliding window), Mistral (sliding window) and Gemma 2 (alternating
sliding/global layers, soft-capping), each with a sliding window shorter than the prompts.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, TrainingArguments

from prefillshare.app.training import batches, tasks
from prefillshare.app.training.tokenizer import load_tokenizer
from prefillshare.app.training.trainer import enable_checkpointing_with_prefix

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "checkpoints" / "tokenizer"
WINDOW = 8  # shorter than every prompt below (~40-70 tokens)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(arch: str, vocab: int):
    if arch == "llama":
        return LlamaConfig(vocab_size=vocab, **SMALL)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=vocab, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                           layer_types=["sliding_attention"] * 2, **SMALL)
    if arch == "mistral":
        return MistralConfig(vocab_size=vocab, sliding_window=WINDOW, **SMALL)
    return Gemma2Config(vocab_size=vocab, sliding_window=WINDOW, query_pre_attn_scalar=8, **SMALL)


ARCHS = ("llama", "qwen2", "mistral", "gemma2")


def build(arch: str, vocab: int, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(arch, vocab)
    cfg._attn_implementation = "eager" if arch == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def encoded(tok):
    enc = batches.encode(tok, tasks.make_examples(4, seed=2)[:7])
    assert len({len(e.prompt) for e in enc}) > 1 and min(len(e.prompt) for e in enc) > 3 * WINDOW
    return enc


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_equal_to_base_gives_the_private_loss_per_example_in_a_padded_batch(arch, tok, encoded):
    model = build(arch, len(tok))
    if arch != "llama":
        assert getattr(model.config, "sliding_window", None) == WINDOW
    shared, count = batches.shared_nll(model, model, encoded)
    private, pcount = batches.private_nll(model, encoded)
    for i, e in enumerate(encoded):
        alone, n = batches.private_nll(model, [e])  # no padding at all
        assert int(count[i]) == int(pcount[i]) == int(n[0]) == len(e.response)
        torch.testing.assert_close(shared[i], alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(private[i], alone[0], rtol=1e-5, atol=1e-5)


def test_right_padding_the_prefix_would_change_a_sliding_window_models_loss(tok, encoded):
    """Why the prefix is left-padded: with pads between prefix and own tokens, a window counted
    in cache slots sees other tokens (the error the issue measured)."""
    model = build("mistral", len(tok))
    batch = batches.collate(encoded, 0)
    lengths = batch.prefix_mask.sum(1)
    width = batch.prefix_ids.shape[1]
    right_ids = torch.zeros_like(batch.prefix_ids)
    right_mask = torch.zeros_like(batch.prefix_mask)
    for i, n in enumerate(lengths.tolist()):
        right_ids[i, :n] = batch.prefix_ids[i, width - n:]
        right_mask[i, :n] = 1
    cache = DynamicCache()  # full layers: nothing cropped to the window
    with torch.no_grad():
        model(input_ids=right_ids, attention_mask=right_mask, past_key_values=cache, use_cache=True)
    kv = batches.PrefixKV([(layer.keys, layer.values) for layer in cache.layers], right_mask, lengths)
    wrong, _ = batches.shared_nll_batch(model, kv, batch)
    right, _ = batches.shared_nll(model, model, encoded)
    assert ((wrong - right) / batch.own_mask.sum(1)).abs().max() > 1e-2  # measured ~0.03 nats per token


@pytest.mark.parametrize("arch", ("llama", "gemma2"))
def test_one_copy_lora_base_kv_is_bit_identical_and_only_adapters_train(arch, tok, encoded, tmp_path):
    from peft import LoraConfig, get_peft_model

    from prefillshare.app.training.trainer import CacheConditionedTrainer

    base = build(arch, len(tok))
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 init_lora_weights=False))
    batch = batches.collate(encoded, 0)
    with peft_model.disable_adapter():
        off = batches.prefix_kv(peft_model, batch.prefix_ids, batch.prefix_mask)
    ref = batches.prefix_kv(base, batch.prefix_ids, batch.prefix_mask)
    on = batches.prefix_kv(peft_model, batch.prefix_ids, batch.prefix_mask)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(off.layers, ref.layers))
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(on.layers, ref.layers))  # the adapter is live
    # the trainer's loss path: base KV from the same weights, adapters off; gradients reach adapters only
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = CacheConditionedTrainer(model=peft_model, args=args, method="cache_conditioned")
    peft_model.train()
    kv = trainer.base_kv(peft_model, batch)
    nll, count = batches.shared_nll_batch(peft_model, kv, batch)
    (nll.sum() / count.sum()).backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert all(not p.requires_grad for n, p in peft_model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("arch", ("mistral", "gemma2"))
def test_gradient_checkpointing_keeps_the_prefix_kv_same_loss_and_gradients(arch, tok, encoded):
    base = build(arch, len(tok))
    dec = build(arch, len(tok), seed=1)
    batch = batches.collate(encoded, 0)
    kv = batches.prefix_kv(base, batch.prefix_ids, batch.prefix_mask)
    results, calls = [], []
    for checkpointing in (False, True):
        model = copy.deepcopy(dec).train()
        if checkpointing:
            enable_checkpointing_with_prefix(model)
        seen = []
        model.model.layers[0].self_attn.register_forward_hook(lambda *_, seen=seen: seen.append(1), with_kwargs=True)
        nll, count = batches.shared_nll_batch(model, kv, batch)
        loss = nll.sum() / count.sum()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        calls.append(len(seen))
    assert calls == [1, 2]  # checkpointing really recomputed the layer in the backward pass
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l0, l1, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-5, atol=1e-6, msg=n)
    # the prefix KV was read, never grown, by the recomputed layers
    assert all(k.shape[2] == batch.prefix_ids.shape[1] for k, _ in kv.layers)
