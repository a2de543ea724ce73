"""A random-weight checkpoint of the shipped shape, for tests that need a real one but no training."""
from __future__ import annotations

from prefillshare.app.models.shapes import llama_config


def save_random_model(out_dir, tokenizer_dir, seed: int = 0, **overrides):
    """A random-weight model of the shipped shape saved as a checkpoint (bf16) with the tokenizer.

    ``overrides`` change config fields (e.g. ``num_hidden_layers=2``) to build incompatible variants.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from prefillshare.app.models.checkpoint import save_model

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = llama_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    return save_model(LlamaForCausalLM(cfg), out_dir, tokenizer_dir)
