"""The shipped model shape (docs/DESIGN.md), one place for every part that builds a model."""
from __future__ import annotations

from transformers import LlamaConfig


def llama_config(vocab_size: int, bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 0) -> LlamaConfig:
    """LlamaForCausalLM config: hidden 192, 4 layers, 3 heads, 1 KV head, head_dim 64, tied embeddings."""
    if vocab_size > 1024:
        raise ValueError(f"vocab_size {vocab_size} exceeds the shipped limit of 1024")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=512,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="bfloat16",
    )

