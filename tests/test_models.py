"""Prefill-module identity, decode manifests and the compatibility check."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.models.compat import check
from app.models.identity import prefill_module_id, tokenizer_hash
from app.models.manifest import DecodeManifest, ManifestError, read_manifest, write_manifest
from app.models.shapes import save_random_model

TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "tokenizer"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("m") / "base", TOKENIZER, seed=0)


def _decoder_from(base: Path, out: Path, method: str = "cache_conditioned", base_id: str | None = None) -> Path:
    shutil.copytree(base, out)
    write_manifest(out, DecodeManifest(agent="lookup", prefill_module_id=base_id or prefill_module_id(base),
                                       tokenizer_hash=tokenizer_hash(base), training={"method": method}))
    return out


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_id_is_stable_across_copies_and_changes_with_weights(base, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    assert prefill_module_id(copy) == prefill_module_id(base)
    assert prefill_module_id(base).startswith("pm-")
    tensors = load_file(str(copy / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert prefill_module_id(copy) != prefill_module_id(base)


def test_id_changes_with_config_and_tokenizer(base, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(base, a)
    shutil.copytree(base, b)
    _edit_config(a, rms_norm_eps=1e-6)
    assert prefill_module_id(a) != prefill_module_id(base)
    tok = json.loads((b / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][:-1]
    (b / "tokenizer.json").write_text(json.dumps(tok))
    assert tokenizer_hash(b) != tokenizer_hash(base)
    assert prefill_module_id(b) != prefill_module_id(base)


def test_compatible_decoder_shares(base, tmp_path):
    verdict = check(base, _decoder_from(base, tmp_path / "dec"))
    assert verdict.shared and verdict.reasons == ()
    assert str(verdict) == "shared prefill"


@pytest.mark.parametrize("changes, reason", [
    ({"num_hidden_layers": 3}, "number of layers"),
    ({"num_key_value_heads": 3}, "number of KV heads"),
    ({"head_dim": 32}, "head dim"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_theta": 500000.0}, "RoPE"),
    ({"dtype": "float32", "torch_dtype": "float32"}, "dtype"),
])
def test_compat_rejects_each_shape_mismatch_with_reason(base, tmp_path, changes, reason):
    dec = _decoder_from(base, tmp_path / "dec")
    _edit_config(dec, **changes)
    verdict = check(base, dec)
    assert not verdict.shared
    assert len(verdict.reasons) == 1 and verdict.reasons[0].startswith(reason), verdict.reasons
    assert str(verdict).startswith("private prefill: ")


def test_compat_rejects_other_tokenizer(base, tmp_path):
    dec = _decoder_from(base, tmp_path / "dec")
    tok = json.loads((dec / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][:-3]
    (dec / "tokenizer.json").write_text(json.dumps(tok))
    verdict = check(base, dec)
    assert not verdict.shared and any(r.startswith("tokenizer differs") for r in verdict.reasons)


def test_compat_rejects_decoder_of_another_base_and_non_cc_training(base, tmp_path):
    other = _decoder_from(base, tmp_path / "other", base_id="pm-0000000000000000")
    verdict = check(base, other)
    assert verdict.reasons == (f"decoder was trained on prefill module pm-0000000000000000, not {prefill_module_id(base)}",)
    fullft = _decoder_from(base, tmp_path / "fullft", method="full_ft")
    verdict = check(base, fullft)
    assert not verdict.shared and "full_ft" in verdict.reasons[0]


def test_missing_or_malformed_manifest_is_a_clear_error(base, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(base, plain)
    with pytest.raises(ManifestError, match=f"{plain}: no prefillshare.json"):
        check(base, plain)
    (plain / "prefillshare.json").write_text('{"kind": "decode_module", "agent": "x"')
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(plain)
    (plain / "prefillshare.json").write_text(json.dumps({"kind": "decode_module", "agent": "x",
                                                         "prefill_module_id": "pm-1", "tokenizer_hash": "t",
                                                         "training": {"method": "magic"}}))
    with pytest.raises(ManifestError, match="training.method"):
        read_manifest(plain)


def test_bf16_on_disk(base):
    tensors = load_file(str(base / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 1 and cfg["head_dim"] == 64 and cfg["tie_word_embeddings"]
