"""Stable identity of a prefill module: a hash of its weights, config and tokenizer.

Two directories holding the same model get the same id wherever they live; changing one
weight, one KV-relevant config field or one merge of the tokenizer changes it. The id names
the KV a prefill module produces, so it keys the KV pool and appears in decoder manifests.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import struct
from pathlib import Path

from prefillshare.app.errors import PrefillShareLibraryError

# config fields that do not change what the model computes
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "architectures", "torch_dtype_str", "use_cache"}
# tokenizer.json sections that decide token ids
_TOKENIZER_SECTIONS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor")


class CheckpointError(PrefillShareLibraryError, ValueError):
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


# safetensors dtype codes -> the torch dtype names the digest has always spelled (str(tensor.dtype))
_TORCH_DTYPE = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
                "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _tensor_index(f: Path) -> dict[str, dict]:
    """A safetensors file's header: {tensor name: {"dtype", "shape", "data_offsets"}}, offsets from
    the start of the data (the file's layout: u64 header length, JSON header, tensor bytes)."""
    with f.open("rb") as fh:
        try:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        except (struct.error, ValueError) as e:
            raise CheckpointError(f"{f}: not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["data_offsets"] = [8 + n + o for o in entry["data_offsets"]]
    return header


def weights_digest(path: str | Path) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes) of the safetensors files, by name. Read
    from the files' own layout (header, then raw little-endian bytes), mapped, never as tensors:
    the app builder hashes a base without importing torch or copying its weights."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights")
    entries = sorted((name, f, e) for f in files for name, e in _tensor_index(f).items())
    h = hashlib.sha256()
    maps: dict[Path, mmap.mmap] = {}
    try:
        for name, f, e in entries:
            if f not in maps:
                with f.open("rb") as fh:
                    maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            begin, end = e["data_offsets"]
            dtype = _TORCH_DTYPE.get(e["dtype"])
            if dtype is None:
                raise CheckpointError(f"{f}: tensor {name} has dtype {e['dtype']}, which no engine here loads")
            h.update(f"{name}|torch.{dtype}|{tuple(e['shape'])}|".encode())
            h.update(memoryview(maps[f])[begin:end])
    finally:
        for m in maps.values():
            m.close()
    return h.hexdigest()


def prefill_module_id(path: str | Path) -> str:
    """``pm-<16 hex>``: identity of the base at ``path`` (weights + config + tokenizer)."""
    h = hashlib.sha256()
    h.update(weights_digest(path).encode())
    h.update(_canonical(config_hash_material(path)))
    h.update(tokenizer_hash(path).encode())
    return "pm-" + h.hexdigest()[:16]
