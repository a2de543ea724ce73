"""`prefillshare train` -> `eval` -> serve on float32, bfloat16 and float16 bases.

A decoder must share with its base everything the base's KV depends on and everything the
served app checks: the dtype (compat refuses a decoder whose dtype differs), the tokenizer and
its chat template, the vocabulary, RoPE settings, tied embeddings, positions, KV heads and head
dim. The bases here differ from the shipped shape in each of those, so a value taken from a
default rather than from the base shows up as a difference.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prefillshare.app.cli import main as cli
from prefillshare.app.models.checkpoint import TOKENIZER_FILES, save_model, stored_dtype
from prefillshare.app.models.compat import check
from prefillshare.app.models.identity import config_hash_material
from prefillshare.app.models.manifest import read_manifest
from prefillshare.app.training import tasks
from tests.engine_child import CPU_TEST_ENGINE_ENV, KV_CACHE_BYTES

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "checkpoints" / "tokenizer"
SITE = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
CHATML = SITE / "vllm" / "transformers_utils" / "chat_templates" / "template_chatml.jinja"
FAST = ["--steps", "2", "--batch-size", "4", "--no-progress"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_base(out: Path, dtype: torch.dtype, seed: int = 0, init: float = 0.02, positions: int = 2048) -> Path:
    """A small random Llama unlike the shipped one: 2 KV heads of dim 32, untied embeddings, linear
    RoPE scaling with another theta, 2048 positions, a generation config, a chat template."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    tok.chat_template = CHATML.read_text()
    tok_dir = out.with_name(out.name + "-tok")
    tok.save_pretrained(str(tok_dir))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=positions,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=init,
                      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               do_sample=True, temperature=0.7)
    return save_model(model, out, tok_dir, dtype=dtype)


def _chat_data(path: Path) -> Path:
    rows = [{"agent": "desk", "messages": [{"role": "user", "content": tasks.render_prompt(e.context, e.instruction)},
                                           {"role": "assistant", "content": e.answer}]}
            for e in tasks.make_examples(3, seed=4)[:8]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _weight_dtypes(path: Path) -> set[torch.dtype]:
    return {t.dtype for f in path.glob("*.safetensors") for t in load_file(str(f)).values()}


@pytest.mark.parametrize("name", DTYPES)
def test_train_eval_serve_check_on_a_base_of_any_dtype(name, tmp_path):
    dtype = DTYPES[name]
    base = make_base(tmp_path / "base", dtype)
    assert stored_dtype(base) == dtype
    data = _chat_data(tmp_path / "chat.jsonl")
    merged, adapter, full = tmp_path / "merged", tmp_path / "adapter", tmp_path / "full"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", "desk", "--lora", "--lora-rank", "4",
                "--out", str(merged), "--adapter-out", str(adapter), *FAST]) == 0
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", "desk", "--out", str(full), *FAST]) == 0
    base_cfg = config_hash_material(base)
    for dec in (merged, adapter, full):
        assert _weight_dtypes(dec) == {dtype}, dec.name
        # the tokenizer (with the base's chat template, used by default) is the base's, file for file
        for f in TOKENIZER_FILES:
            assert (dec / f).is_file() == (base / f).is_file(), (dec.name, f)
            if (base / f).is_file():
                assert (dec / f).read_bytes() == (base / f).read_bytes(), (dec.name, f)
        assert read_manifest(dec).prompt.format == "chat_template"
        # what the served app's build gate runs: the decoder may consume this base's KV
        verdict = check(base, dec)
        assert verdict.shared, (dec.name, verdict.reasons)
        out = tmp_path / f"eval-{dec.name}"
        assert cli(["eval", "--base", str(base), "--decoder", str(dec), "--data", str(data), "--out", str(out)]) == 0
        result = json.loads(out.with_suffix(".json").read_text())
        assert result["agents"]["desk"]["prefillshare"]["n"] == 8
    for dec in (merged, full):  # every config field is the base's: shapes, RoPE, ties, positions, dtype
        assert config_hash_material(dec) == base_cfg, dec.name
        assert json.loads((dec / "generation_config.json").read_text())["temperature"] == 0.7


def test_layer_split_baseline_stores_its_layers_in_the_base_dtype(tmp_path):
    base = make_base(tmp_path / "base", torch.float16)
    data = _chat_data(tmp_path / "chat.jsonl")
    out = tmp_path / "ls"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", "desk", "--method", "layer_split",
                "--shared-layers", "1", "--out", str(out), *FAST]) == 0
    assert _weight_dtypes(out) == {torch.float16}
    assert config_hash_material(out) == config_hash_material(base)


def test_examples_are_cut_to_the_bases_positions_by_default(tmp_path, capsys):
    base = make_base(tmp_path / "base", torch.float32, positions=32)
    data = _chat_data(tmp_path / "chat.jsonl")
    from prefillshare.app.training.tokenizer import load_tokenizer

    tok = load_tokenizer(base)
    users = [json.loads(line)["messages"][0]["content"] for line in data.read_text().splitlines()]
    assert max(len(tok(u)["input_ids"]) for u in users) > 32  # some examples are longer than the base's positions
    out = tmp_path / "dec"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", "desk", "--out", str(out), *FAST]) == 0
    assert read_manifest(out).training["max_length"] == 32
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", "desk", "--max-length", "64",
                "--out", str(tmp_path / "long"), *FAST]) == 2
    assert "--max-length 64 exceeds the base's max_position_embeddings 32" in capsys.readouterr().err


def test_stored_dtype_reads_the_weights_when_config_names_none(tmp_path):
    base = make_base(tmp_path / "base", torch.float16)
    cfg = json.loads((base / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    (base / "config.json").write_text(json.dumps(cfg))
    assert stored_dtype(base) == torch.float16
    cfg["torch_dtype"] = "bfloat16"  # the older key
    (base / "config.json").write_text(json.dumps(cfg))
    assert stored_dtype(base) == torch.bfloat16


@pytest.mark.engine
def test_a_decoder_trained_on_a_float32_base_decodes_on_its_kv_in_vllm(tmp_path):
    """The served path: the base's engine prefills, the trained decoder's engine loads that KV
    through the connector (its compat check passes) and decodes the transformers reference's tokens."""
    import asyncio
    import os
    import uuid

    from prefillshare.app.engine.async_engine import Engine, EngineConfig, Sampling
    from prefillshare.app.engine.pool.handover import connector_config
    from prefillshare.app.engine.pool.kv_pool import PoolSpec
    from prefillshare.app.models.checkpoint import load_model
    from prefillshare.app.models.identity import prefill_module_id
    from prefillshare.app.reference import shared_greedy
    from prefillshare.app.training.tokenizer import load_tokenizer

    base = make_base(tmp_path / "base", torch.float32, seed=1, init=0.1)  # peaked logits: no greedy ties
    data = _chat_data(tmp_path / "chat.jsonl")
    dec = tmp_path / "dec"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", "desk", "--lora", "--lora-rank", "4",
                "--lr", "5e-2", "--out", str(dec), *FAST]) == 0
    tok = load_tokenizer(base)
    prompts = [tok.apply_chat_template([{"role": "user", "content": tasks.render_prompt(e.context, e.instruction)}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for e in tasks.make_examples(2, seed=9)[:2]]
    pool = PoolSpec(path=f"/dev/shm/ps-test-anybase-{uuid.uuid4().hex[:8]}", capacity_bytes=64 << 20,
                    lease_timeout_s=120)
    pm = prefill_module_id(base)
    common = dict(dtype="float32", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=512, block_size=32,
                  skip_tokenizer_init=True, request_timeout_s=240,
                  extra_env=CPU_TEST_ENGINE_ENV)
    cfgs = [EngineConfig(model=str(base), **common, kv_transfer_config=connector_config("producer", pm, pool)),
            EngineConfig(model=str(dec), **common, kv_transfer_config=connector_config(
                "consumer", pm, pool, scope="desk"))]  # the app's plan checks compatibility (compat.check, above)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

    async def run():
        engines = await asyncio.gather(*[Engine.start(c) for c in cfgs])
        try:
            outs = []
            for p in prompts:
                await engines[0].prefill(p, cache_salt="t", kv_transfer_params={"fanout": 1})
                outs.append(await engines[1].complete(p, Sampling(max_tokens=6, ignore_eos=True), cache_salt="t"))
            return outs
        finally:
            for e in engines:
                e.shutdown()

    try:
        outs = asyncio.run(run())
    finally:
        import shutil

        shutil.rmtree(pool.path, ignore_errors=True)
    hf_base, hf_dec = load_model(base), load_model(dec)
    for p, o in zip(prompts, outs):
        assert o.num_cached_tokens == len(p) - 1  # the base's KV was loaded, not recomputed
        assert o.token_ids == shared_greedy(hf_base, hf_dec, p, 6)
