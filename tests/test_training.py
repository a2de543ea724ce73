"""Cache-conditioned fine-tuning, its baselines, batching, resume, and the data format."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from random_checkpoint import save_random_model
from safetensors.torch import load_file

from prefillshare.app.cli import main as cli
from prefillshare.app.models.checkpoint import load_decoder, load_model
from prefillshare.app.models.compat import check
from prefillshare.app.models.manifest import read_manifest
from prefillshare.app.training import batches, tasks
from prefillshare.app.training.tokenizer import load_tokenizer
from prefillshare.app.training.trainer import TrainConfig, train_decoder

TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "tokenizer"
FAST = dict(steps=3, batch_size=4, lr=5e-3, warmup=1)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("t") / "base", TOKENIZER, seed=3)


@pytest.fixture(scope="module")
def examples():
    return tasks.make_examples(12, seed=1)


def _files_state(path: Path) -> dict:
    return {k: v.clone() for k, v in load_file(str(path / "model.safetensors")).items()}


def test_batched_losses_equal_per_example_losses(base, examples):
    tok = load_tokenizer(TOKENIZER)
    model, other = load_model(base), load_model(base)
    torch.manual_seed(0)
    for p in other.parameters():  # a decoder that differs from the base
        p.data += 0.02 * torch.randn_like(p)
    enc = batches.encode(tok, examples[:6])
    assert len({len(e.prompt) for e in enc}) > 1 and len({len(e.response) for e in enc}) > 1
    for fn in (lambda b: batches.shared_nll(model, other, b), lambda b: batches.private_nll(other, b)):
        nll, count = fn(enc)
        for i, e in enumerate(enc):
            one_nll, one_count = fn([e])
            assert int(count[i]) == int(one_count[0]) == len(e.response)
            torch.testing.assert_close(nll[i], one_nll[0], rtol=1e-4, atol=1e-4)


def test_cache_conditioned_changes_only_decoder_weights(base, examples, tmp_path):
    before = _files_state(base)
    out = train_decoder(base, examples, "lookup", tmp_path / "cc", TrainConfig(**FAST), progress=False)
    after = _files_state(base)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    dec = _files_state(out)
    assert any(not torch.equal(dec[k], before[k]) for k in before)
    manifest = read_manifest(out)
    assert manifest.method == "cache_conditioned" and manifest.agent == "lookup"
    assert check(base, out).shared


def test_base_in_memory_gets_no_gradient(base, examples):
    """The frozen base: no .grad ever appears on it during a cache-conditioned step."""
    tok = load_tokenizer(TOKENIZER)
    frozen, dec = load_model(base), load_model(base)
    frozen.requires_grad_(False)
    dec.train()
    nll, count = batches.shared_nll(frozen, dec, batches.encode(tok, examples[:4]))
    (nll.sum() / count.sum()).backward()
    assert all(p.grad is None for p in frozen.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in dec.parameters())


def test_layer_split_keeps_lower_layers_and_stores_only_upper(base, examples, tmp_path):
    out = train_decoder(base, examples, "route", tmp_path / "ls",
                        TrainConfig(method="layer_split", shared_layers=2, **FAST), progress=False)
    stored = load_file(str(out / "upper_layers.safetensors"))
    assert stored and all(k.startswith(("model.layers.2.", "model.layers.3.", "model.norm.")) for k in stored)
    full, ref = load_decoder(out, base).state_dict(), load_model(base).state_dict()
    for k in ref:
        lower = k.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1.", "lm_head"))
        assert torch.equal(full[k], ref[k]) == lower or (not lower and k.endswith("norm.weight")), k
    verdict = check(base, out)
    assert not verdict.shared and "layer_split" in verdict.reasons[0]


def test_lora_decoder_exports_plain_merged_checkpoint(base, examples, tmp_path):
    out = train_decoder(base, examples, "reschedule", tmp_path / "lora",
                        TrainConfig(lora=True, lora_rank=4, **FAST), progress=False)
    tensors = load_file(str(out / "model.safetensors"))
    assert not any("lora" in k for k in tensors)
    assert set(tensors) == set(_files_state(base))
    assert any(not torch.equal(tensors[k], v) for k, v in _files_state(base).items())
    assert read_manifest(out).training["lora"] is True


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(base, examples, tmp_path):
    cfg = TrainConfig(steps=4, batch_size=4, lr=5e-3, warmup=1, save_every=0)
    straight = train_decoder(base, examples, "lookup", tmp_path / "a", cfg, progress=False)
    assert train_decoder(base, examples, "lookup", tmp_path / "b", cfg, state_dir=tmp_path / "st",
                         progress=False, stop_after=2) is None
    assert not (tmp_path / "b").exists()
    resumed = train_decoder(base, examples, "lookup", tmp_path / "b", cfg, state_dir=tmp_path / "st",
                            resume=True, progress=False)
    a, b = _files_state(straight), _files_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_data_command_is_seeded_and_split_by_context(tmp_path):
    assert cli(["data", "--out", str(tmp_path / "a"), "--contexts", "40", "--seed", "5"]) == 0
    assert cli(["data", "--out", str(tmp_path / "b"), "--contexts", "40", "--seed", "5"]) == 0
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    train = tasks.read_jsonl(tmp_path / "a" / "train.jsonl")
    test = tasks.read_jsonl(tmp_path / "a" / "test.jsonl")
    assert {e.context for e in train}.isdisjoint({e.context for e in test})
    assert set(tasks.iter_agents(test)) == set(tasks.AGENTS) and len(tasks.AGENTS) >= 4
    for e in test:  # every agent's prompt is the shared context plus its instruction
        assert e.prompt.startswith(e.context) and e.instruction in e.prompt


def test_records_and_each_agents_examples_do_not_depend_on_the_other_agents():
    every = tasks.make_examples(30, seed=4)
    two = tasks.make_examples(30, seed=4, agents=("route", "lookup"))
    assert {e for e in every if e.agent in ("lookup", "route")} == set(two) and len(two) == 60
    for e in every:
        if e.agent == "route":
            assert e.answer == tasks.HUB[e.context.split("city: ")[1].split("\n")[0]]


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON"),
    ('["a"]', "expected a JSON object"),
    ('{"agent": "lookup", "context": "c", "instruction": "i"}', "missing field 'answer'"),
    ('{"agent": "lookup", "context": "c", "instruction": "i", "answer": 3}', "field 'answer' must be a string"),
    ('{"agent": "poet", "context": "c", "instruction": "i", "answer": "a"}', "unknown agent 'poet'"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, line, problem):
    good = json.dumps({"agent": "lookup", "context": "c", "instruction": "i", "answer": "a"})
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(tasks.DataError) as err:
        tasks.read_jsonl(path, known_agents=tasks.AGENTS)
    assert str(err.value).startswith(f"{path}:2: ") and problem in str(err.value)


def test_train_command_rejects_bad_data_without_writing(base, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"agent": "lookup"}\n')
    out = tmp_path / "dec"
    assert cli(["train", "--base", str(base), "--data", str(path), "--agent", "lookup", "--out", str(out),
                "--steps", "1", "--no-progress"]) == 2
    assert f"{path}:1: missing field 'context'" in capsys.readouterr().err
    assert not out.exists()


def test_every_subcommand_has_help(capsys):
    for cmd in ("data", "train", "eval"):
        with pytest.raises(SystemExit) as e:
            cli([cmd, "--help"])
        assert e.value.code == 0
        assert "usage: prefillshare " + cmd in capsys.readouterr().out
