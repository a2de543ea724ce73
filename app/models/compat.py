"""Can a decode module consume a prefill module's KV? A yes, or "private prefill" with reasons.

KV handed over must have the shape the decoder's attention expects (layers, KV heads, head
dim), the same positions encoding (RoPE), the same dtype, and come from the same token ids
(tokenizer). Beyond shape, the decoder must have been trained cache-conditioned on THIS base:
any other decoder reads KV it was never trained on (the "naive reuse" baseline). An
adapter-only decoder (PEFT LoRA) runs on the base's own weights, so it is checked against the
base it names (``adapter.base_prefill_module_id``) and its adapter files, not a config of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefillshare.app.models.identity import CheckpointError, load_config_dict, prefill_module_id, tokenizer_hash
from prefillshare.app.models.manifest import DecodeManifest, read_manifest


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


def check_adapter_files(decoder_dir: str | Path, adapter) -> None:
    """An adapter directory holds PEFT's files, and they say what the manifest says."""
    import json

    cfg_path = Path(decoder_dir) / "adapter_config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{decoder_dir}: no adapter_config.json (the manifest describes a PEFT adapter)")
    if not any((Path(decoder_dir) / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise CheckpointError(f"{decoder_dir}: no adapter_model.safetensors")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e.msg})") from None
    if cfg.get("r") != adapter.rank:
        raise CheckpointError(f"{cfg_path}: rank r={cfg.get('r')} but prefillshare.json says adapter.rank={adapter.rank}")
    targets = cfg.get("target_modules")
    targets = sorted([targets] if isinstance(targets, str) else targets or [])
    if targets != sorted(adapter.target_modules):
        raise CheckpointError(f"{cfg_path}: target_modules {targets} but prefillshare.json says "
                              f"adapter.target_modules={sorted(adapter.target_modules)}")


def check(base_dir: str | Path, decoder_dir: str | Path, base_id: str | None = None,
          manifest: DecodeManifest | None = None) -> Compatibility:
    """Compare a decoder checkpoint (with its manifest) against a prefill module checkpoint.

    Raises ManifestError/CheckpointError for a decoder without manifest or a broken checkpoint;
    returns ``Compatibility(False, reasons)`` for a well-formed decoder that cannot share.
    ``manifest``: the decoder's, when the caller has read it already.
    """
    manifest = manifest or read_manifest(decoder_dir)
    reasons = []
    base_tok = tokenizer_hash(base_dir)
    dec_tok = tokenizer_hash(decoder_dir) if (Path(decoder_dir) / "tokenizer.json").is_file() or \
        manifest.adapter is None else manifest.tokenizer_hash
    if base_tok != dec_tok:
        reasons.append(f"tokenizer differs: prefill module {base_tok}, decoder {dec_tok}")
    elif manifest.tokenizer_hash != base_tok:
        reasons.append(f"tokenizer differs: manifest declares {manifest.tokenizer_hash}, prefill module has {base_tok}")
    base_id = base_id or prefill_module_id(base_dir)
    if manifest.adapter is not None:
        # an adapter runs on the base's own weights: the shapes agree by construction, the base must be THIS one
        check_adapter_files(decoder_dir, manifest.adapter)
        if manifest.adapter.base_prefill_module_id != base_id:
            reasons.append(f"adapter belongs to base {manifest.adapter.base_prefill_module_id}, not {base_id} "
                           "(an adapter only runs on the weights it was trained on)")
    else:
        reasons += check_configs(load_config_dict(base_dir), load_config_dict(decoder_dir))
    adapter_said_it = manifest.adapter is not None and manifest.adapter.base_prefill_module_id == manifest.prefill_module_id
    if manifest.prefill_module_id != base_id and not adapter_said_it:
        reasons.append(f"decoder was trained on prefill module {manifest.prefill_module_id}, not {base_id}")
    if manifest.method != "cache_conditioned":
        reasons.append(f"decoder was trained with {manifest.method} (its own prefill), not cache-conditioned on the shared KV")
    return Compatibility(not reasons, tuple(reasons))
