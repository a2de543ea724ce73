"""The decode-module manifest ``prefillshare.json``, written beside a decoder's checkpoint.

It says which prefill module the decoder consumes (base id, tokenizer hash) and how it was
trained, so that a server can decide, before loading anything, whether the decoder may use
the shared prefill or must prefill privately.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "prefillshare.json"
METHODS = ("cache_conditioned", "full_ft", "layer_split")


class ManifestError(ValueError):
    """Missing or malformed manifest; the message names the file."""


@dataclass(frozen=True)
class DecodeManifest:
    agent: str
    prefill_module_id: str
    tokenizer_hash: str
    training: dict = field(default_factory=dict)  # {"method": ..., "steps", "lr", "lora", "shared_layers", ...}
    kind: str = "decode_module"

    @property
    def method(self) -> str:
        return self.training.get("method", "")

    @property
    def weights(self) -> str:
        """"full": an HF checkpoint; "upper_layers": only the layers above the shared ones (layer-split)."""
        return self.training.get("weights", "full")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def write_manifest(directory: str | Path, manifest: DecodeManifest) -> Path:
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_name(MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, path)
    return path


def read_manifest(directory: str | Path) -> DecodeManifest:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{directory}: no {MANIFEST_NAME} (not a decode module; train it with `prefillshare train`)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: expected a JSON object")
    if data.get("kind") != "decode_module":
        raise ManifestError(f"{path}: kind must be 'decode_module', got {data.get('kind')!r}")
    for key in ("agent", "prefill_module_id", "tokenizer_hash"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ManifestError(f"{path}: field {key!r} missing or not a string")
    training = data.get("training", {})
    if not isinstance(training, dict) or training.get("method") not in METHODS:
        raise ManifestError(f"{path}: training.method must be one of {', '.join(METHODS)}")
    return DecodeManifest(data["agent"], data["prefill_module_id"], data["tokenizer_hash"], training)
