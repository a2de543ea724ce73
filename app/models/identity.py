"""Stable identity of a prefill module: a hash of its weights, config and tokenizer.

Two directories holding the same model get the same id wherever they live; changing one
weight, one KV-relevant config field or one merge of the tokenizer changes it. The id names
the KV a prefill module produces, so it keys the KV pool and appears in decoder manifests.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

# config fields that do not change what the model computes
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "architectures", "torch_dtype_str", "use_cache"}
# tokenizer.json sections that decide token ids
_TOKENIZER_SECTIONS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor")


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or holds something unreadable; names the path."""


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def load_config_dict(path: str | Path) -> dict:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint)")
    return json.loads(f.read_text())


def tokenizer_hash(path: str | Path) -> str:
    """Hash of the parts of tokenizer.json that decide token ids (formatting is ignored)."""
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json")
    data = json.loads(f.read_text())
    return "tok-" + hashlib.sha256(_canonical({k: data.get(k) for k in _TOKENIZER_SECTIONS})).hexdigest()[:16]


def config_hash_material(path: str | Path) -> dict:
    cfg = load_config_dict(path)
    return {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}


def weights_digest(path: str | Path) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes) of the safetensors files, by name."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights")
    h = hashlib.sha256()
    entries = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            entries.extend((name, f) for name in st.keys())
    for name, f in sorted(entries):
        with safe_open(str(f), framework="pt") as st:
            t = st.get_tensor(name)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def prefill_module_id(path: str | Path) -> str:
    """``pm-<16 hex>``: identity of the base at ``path`` (weights + config + tokenizer)."""
    h = hashlib.sha256()
    h.update(weights_digest(path).encode())
    h.update(_canonical(config_hash_material(path)))
    h.update(tokenizer_hash(path).encode())
    return "pm-" + h.hexdigest()[:16]
