"""Can a decode module consume a prefill module's KV? A yes, or "private prefill" with reasons.

KV handed over must have the shape the decoder's attention expects (layers, KV heads, head
dim), the same positions encoding (RoPE), the same dtype, and come from the same token ids
(tokenizer). Beyond shape, the decoder must have been trained cache-conditioned on THIS base:
any other decoder reads KV it was never trained on (the "naive reuse" baseline).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.models.identity import load_config_dict, prefill_module_id, tokenizer_hash
from app.models.manifest import read_manifest


@dataclass(frozen=True)
class Compatibility:
    shared: bool                 # True: the decoder may use the shared prefill
    reasons: tuple[str, ...] = ()  # why not, readable by a user

    @property
    def mode(self) -> str:
        return "shared prefill" if self.shared else "private prefill"

    def __str__(self) -> str:
        return self.mode if self.shared else f"{self.mode}: " + "; ".join(self.reasons)


def _head_dim(cfg: dict) -> int | None:
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return None


def _rope(cfg: dict) -> dict:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" in cfg:
        rope.setdefault("rope_theta", cfg["rope_theta"])
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def _dtype(cfg: dict) -> str | None:
    return cfg.get("dtype") or cfg.get("torch_dtype")


def check_configs(base: dict, decoder: dict) -> list[str]:
    """Reasons the KV of a model with config ``base`` cannot feed one with config ``decoder``."""
    reasons = []
    pairs = [
        ("number of layers", base.get("num_hidden_layers"), decoder.get("num_hidden_layers")),
        ("number of KV heads", base.get("num_key_value_heads", base.get("num_attention_heads")),
         decoder.get("num_key_value_heads", decoder.get("num_attention_heads"))),
        ("head dim", _head_dim(base), _head_dim(decoder)),
        ("RoPE settings", _rope(base), _rope(decoder)),
        ("dtype", _dtype(base), _dtype(decoder)),
    ]
    for what, b, d in pairs:
        if b != d:
            reasons.append(f"{what} differs: prefill module has {b}, decoder has {d}")
    return reasons


def check(base_dir: str | Path, decoder_dir: str | Path, base_id: str | None = None) -> Compatibility:
    """Compare a decoder checkpoint (with its manifest) against a prefill module checkpoint.

    Raises ManifestError/CheckpointError for a decoder without manifest or a broken checkpoint;
    returns ``Compatibility(False, reasons)`` for a well-formed decoder that cannot share.
    """
    manifest = read_manifest(decoder_dir)
    reasons = []
    base_tok, dec_tok = tokenizer_hash(base_dir), tokenizer_hash(decoder_dir)
    if base_tok != dec_tok:
        reasons.append(f"tokenizer differs: prefill module {base_tok}, decoder {dec_tok}")
    elif manifest.tokenizer_hash != base_tok:
        reasons.append(f"tokenizer differs: manifest declares {manifest.tokenizer_hash}, prefill module has {base_tok}")
    base_cfg = load_config_dict(base_dir)
    dec_cfg = load_config_dict(decoder_dir)
    reasons += check_configs(base_cfg, dec_cfg)
    base_id = base_id or prefill_module_id(base_dir)
    if manifest.prefill_module_id != base_id:
        reasons.append(f"decoder was trained on prefill module {manifest.prefill_module_id}, not {base_id}")
    if manifest.method != "cache_conditioned":
        reasons.append(f"decoder was trained with {manifest.method} (its own prefill), not cache-conditioned on the shared KV")
    return Compatibility(not reasons, tuple(reasons))
