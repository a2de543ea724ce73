"""Prefill-module identity, decode manifests and the compatibility check."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from random_checkpoint import save_random_model
from safetensors.torch import load_file, save_file

from prefillshare.app.models.compat import check
from prefillshare.app.models.identity import CheckpointError, prefill_module_id, tokenizer_hash, weights_digest
from prefillshare.app.models.manifest import DecodeManifest, ManifestError, read_manifest, write_manifest

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


def _digest_through_torch(path: Path) -> str:
    """The digest as tensors spell it: name, str(dtype), shape, then the tensor's bytes."""
    import hashlib

    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_digest_read_from_the_files_layout_equals_the_tensors_digest(base, tmp_path):
    """weights_digest reads raw bytes without torch; it must give the id every manifest recorded."""
    assert weights_digest(base) == _digest_through_torch(base)
    odd = tmp_path / "odd"
    odd.mkdir()
    save_file({"b.scalar": torch.tensor(3.5, dtype=torch.float64), "a.ids": torch.arange(6, dtype=torch.int64),
               "c.half": torch.randn(2, 3, dtype=torch.float16)}, str(odd / "model-00002.safetensors"))
    save_file({"z.bf16": torch.randn(4, 1, dtype=torch.bfloat16), "d.flag": torch.tensor([True, False])},
              str(odd / "model-00001.safetensors"), metadata={"format": "pt"})
    assert weights_digest(odd) == _digest_through_torch(odd)
    (odd / "model-00003.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="model-00003.safetensors: not a safetensors file"):
        weights_digest(odd)


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


def _adapter_from(base: Path, out: Path, base_id: str | None = None, rank: int = 4) -> Path:
    """A real PEFT adapter on the base, exported the way `prefillshare train --lora` does."""
    from peft import LoraConfig, get_peft_model

    from prefillshare.app.models.checkpoint import load_model, save_adapter
    from prefillshare.app.models.manifest import AdapterSpec

    targets = ("q_proj", "v_proj")
    model = get_peft_model(load_model(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets)))
    base_id = base_id or prefill_module_id(base)
    manifest = DecodeManifest(agent="lookup", prefill_module_id=base_id, tokenizer_hash=tokenizer_hash(base),
                              training={"method": "cache_conditioned", "lora": True},
                              adapter=AdapterSpec(base_id, rank, targets, 2.0 * rank))
    return save_adapter(model, out, base, manifest)


def test_adapter_manifest_round_trip_and_compat(base, tmp_path):
    out = _adapter_from(base, tmp_path / "ad")
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    assert not (out / "README.md").exists()  # no generated model card
    m = read_manifest(out)
    assert m.weights == "adapter" and m.adapter.rank == 4 and set(m.adapter.target_modules) == {"q_proj", "v_proj"}
    assert m.adapter.base_prefill_module_id == prefill_module_id(base) and m.prompt.format == "suite"
    assert check(base, out).shared


def test_adapter_of_another_base_is_refused_with_the_reason(base, tmp_path):
    out = _adapter_from(base, tmp_path / "ad", base_id="pm-00000000000000aa")
    verdict = check(base, out)
    assert not verdict.shared
    assert verdict.reasons == (f"adapter belongs to base pm-00000000000000aa, not {prefill_module_id(base)} "
                               "(an adapter only runs on the weights it was trained on)",)


@pytest.mark.parametrize("edit, problem", [
    (lambda d: d["adapter"].update(format="lokr"), "adapter.format must be one of peft"),
    (lambda d: d["adapter"].update(rank=0), "'adapter.rank' must be a positive integer"),
    (lambda d: d["adapter"].pop("base_prefill_module_id"), "'adapter.base_prefill_module_id' missing"),
    (lambda d: d["adapter"].update(target_modules=[]), "'adapter.target_modules' must be a non-empty list"),
    (lambda d: d.update(prompt={"format": "chat_template"}), "'prompt.template_sha256' missing"),
    (lambda d: d.update(prompt={"format": "xml"}), "prompt.format must be one of"),
])
def test_bad_adapter_or_prompt_block_names_the_field(base, tmp_path, edit, problem):
    out = _adapter_from(base, tmp_path / "ad")
    data = json.loads((out / "prefillshare.json").read_text())
    edit(data)
    (out / "prefillshare.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError) as err:
        read_manifest(out)
    assert str(err.value).startswith(f"{out / 'prefillshare.json'}: ") and problem in str(err.value)


def test_adapter_files_that_disagree_with_the_manifest_fail(base, tmp_path):
    from prefillshare.app.models.identity import CheckpointError

    out = _adapter_from(base, tmp_path / "ad")
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["r"] = 16
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="adapter_config.json: rank r=16 but prefillshare.json says adapter.rank=4"):
        check(base, out)
