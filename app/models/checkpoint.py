"""Saving and loading the project's checkpoints (HF safetensors).

A decoder directory is a complete HF checkpoint that vLLM loads, plus ``prefillshare.json``.
A decoder is stored in its base's dtype (:func:`stored_dtype`): the KV it reads was computed
in that dtype, and the serving check refuses a decoder whose dtype differs from its base's.
Layer-split baselines share their lower layers with the base bit for bit, so they store only
the layers they trained (``upper_layers.safetensors``) and are assembled on load.
"""
from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from prefillshare.app.models.identity import CheckpointError
from prefillshare.app.models.manifest import DecodeManifest, read_manifest, write_manifest

# every file a Hugging Face tokenizer may be saved as (fast, sentencepiece, BPE vocab/merges, templates)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UPPER_LAYERS_FILE = "upper_layers.safetensors"


def copy_tokenizer(tokenizer_dir: str | Path, out_dir: str | Path) -> None:
    """Byte-exact copies, so tokenizer hashes of the base and its decoders agree."""
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copyfile(src, Path(out_dir) / name)


def stored_dtype(path: str | Path) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in: config.json's ``dtype`` (``torch_dtype`` in older
    files), else the first floating tensor of its safetensors, else float32 (what transformers assumes)."""
    import json

    from safetensors import safe_open

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name:
        if name not in DTYPES:
            raise CheckpointError(f"{path}: config.json dtype {name!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[name]
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                t = st.get_slice(key)
                dt = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(t.get_dtype())
                if dt is not None:
                    return dt
    return torch.float32


def _staging(out_dir: Path) -> Path:
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, out_dir: Path) -> None:
    """Swap a finished staging dir into place: readers never see a half-written checkpoint."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def save_model(model: PreTrainedModel, out_dir: str | Path, tokenizer_dir: str | Path,
               manifest: DecodeManifest | None = None, extra_files: dict[str, str] | None = None,
               dtype: torch.dtype = torch.bfloat16) -> Path:
    """A whole model in ``dtype`` (a decoder: its base's), with the tokenizer and the manifest."""
    out_dir = Path(out_dir)
    tmp = _staging(out_dir)
    # a copy in ``dtype``, so that config.json's dtype states what the weights are
    copy.deepcopy(model).to(dtype).save_pretrained(str(tmp), safe_serialization=True)
    copy_tokenizer(tokenizer_dir, tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text, encoding="utf-8")
    if manifest is not None:
        write_manifest(tmp, manifest)
    _publish(tmp, out_dir)
    return out_dir


def save_upper_layers(model: PreTrainedModel, first_layer: int, out_dir: str | Path, base_dir: str | Path,
                      manifest: DecodeManifest, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Layer-split decoder: only layers >= ``first_layer`` and the final norm (in ``dtype``, the base's),
    plus the base's config."""
    out_dir = Path(out_dir)
    tmp = _staging(out_dir)
    prefixes = tuple(f"model.layers.{i}." for i in range(first_layer, model.config.num_hidden_layers)) + ("model.norm.",)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k.startswith(prefixes)}
    save_file(state, str(tmp / UPPER_LAYERS_FILE))
    shutil.copyfile(Path(base_dir) / "config.json", tmp / "config.json")
    copy_tokenizer(base_dir, tmp)
    write_manifest(tmp, manifest)
    _publish(tmp, out_dir)
    return out_dir


def save_adapter(peft_model, out_dir: str | Path, tokenizer_dir: str | Path, manifest: DecodeManifest,
                 extra_files: dict[str, str] | None = None, dtype: torch.dtype | None = None) -> Path:
    """Adapter-only decoder: PEFT's ``save_pretrained`` (adapter_config.json + adapter_model.safetensors,
    its tensors cast to ``dtype``, the base's, when given), the tokenizer and the manifest, published whole.
    ``extra_files``: name -> text (e.g. a chat template)."""
    out_dir = Path(out_dir)
    tmp = _staging(out_dir)
    peft_model.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "README.md").unlink(missing_ok=True)  # PEFT's generated model card: boilerplate naming the run's scratch base
    if dtype is not None:  # PEFT saves the adapter in its training dtype
        from safetensors import safe_open

        weights = tmp / "adapter_model.safetensors"
        with safe_open(str(weights), framework="pt") as st:
            metadata = st.metadata()
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(weights)).items()}
        save_file(tensors, str(weights), metadata=metadata)
    copy_tokenizer(tokenizer_dir, tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text, encoding="utf-8")
    write_manifest(tmp, manifest)
    _publish(tmp, out_dir)
    return out_dir


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a checkpoint)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model


def load_decoder(path: str | Path, base_dir: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A decoder of any kind as a full model (layer-split ones are assembled over the base)."""
    manifest = read_manifest(path)
    if manifest.weights == "adapter":
        from peft import PeftModel

        return PeftModel.from_pretrained(load_model(base_dir, dtype), str(path)).merge_and_unload().eval()
    if manifest.weights != "upper_layers":
        return load_model(path, dtype)
    model = load_model(base_dir, dtype)
    upper = load_file(str(Path(path) / UPPER_LAYERS_FILE))
    missing = set(upper) - set(model.state_dict())
    if missing:
        raise CheckpointError(f"{path}: {UPPER_LAYERS_FILE} has tensors the base lacks: {sorted(missing)[:3]}")
    model.load_state_dict({k: v.to(dtype) for k, v in upper.items()}, strict=False)
    return model
