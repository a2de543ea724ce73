"""`prefillshare eval`: the table's columns on a tiny file, and clear errors with nothing written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from random_checkpoint import save_random_model

from prefillshare.app.cli import main as cli
from prefillshare.app.models.checkpoint import load_model, save_upper_layers
from prefillshare.app.models.identity import prefill_module_id, tokenizer_hash
from prefillshare.app.models.manifest import DecodeManifest, write_manifest
from prefillshare.app.training import tasks
from prefillshare.app.training.evaluate import METHODS

TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "tokenizer"
AGENTS = ("lookup", "route")


def _manifest(base: Path, agent: str, method: str, **training) -> DecodeManifest:
    return DecodeManifest(agent=agent, prefill_module_id=prefill_module_id(base), tokenizer_hash=tokenizer_hash(base),
                          training={"method": method, **training})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The shipped layout with random weights: base, decoders, both baselines, per agent."""
    root = tmp_path_factory.mktemp("ev") / "models"
    base = save_random_model(root / "base", TOKENIZER, seed=4)
    for i, agent in enumerate(AGENTS):
        save_random_model(root / "decoders" / agent, TOKENIZER, seed=10 + i)
        write_manifest(root / "decoders" / agent, _manifest(base, agent, "cache_conditioned"))
        save_random_model(root / "baselines" / "fullft" / agent, TOKENIZER, seed=20 + i)
        write_manifest(root / "baselines" / "fullft" / agent, _manifest(base, agent, "full_ft"))
        save_upper_layers(load_model(base), 2, root / "baselines" / "layersplit" / agent, base,
                          _manifest(base, agent, "layer_split", shared_layers=2, weights="upper_layers"))
    return root


@pytest.fixture()
def data(tmp_path) -> Path:
    examples = [e for e in tasks.make_examples(3, seed=9) if e.agent in AGENTS]
    path = tmp_path / "tiny.jsonl"
    tasks.write_jsonl(path, examples)
    return path


def test_eval_writes_table_with_every_column(models, data, tmp_path, capsys):
    out = tmp_path / "res" / "tiny"
    assert cli(["eval", "--data", str(data), "--models", str(models), "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["methods"] == list(METHODS)
    assert list(result["agents"]) == list(AGENTS)
    for row in result["agents"].values():
        assert set(row) == set(METHODS)
        for cell in row.values():
            assert cell["n"] == 3 and 0 <= cell["exact_match"] <= 100 and cell["answer_nll"] > 0
        assert row["base"]["prefill_saved"] == row["full_ft"]["prefill_saved"] == 0
        assert 0.9 < row["prefillshare"]["prefill_saved"] == row["naive_reuse"]["prefill_saved"] < 1
        assert row["layer_split"]["prefill_saved"] == 0.5
        # naive reuse and prefillshare feed different decoders the same base KV
        assert row["naive_reuse"]["answer_nll"] != row["prefillshare"]["answer_nll"]
    md = out.with_suffix(".md").read_text()
    header = md.splitlines()[0]
    for m in METHODS:
        assert f"{m} EM% / NLL" in header
    assert md in capsys.readouterr().out


def _assert_fails_cleanly(args, out: Path, capsys, *needles):
    assert cli(args + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert not out.with_suffix(".json").exists() and not out.with_suffix(".md").exists()


def test_eval_unknown_agent_names_file_and_line(models, data, tmp_path, capsys):
    lines = data.read_text().splitlines()
    lines[1] = json.dumps({"agent": "poet", "context": "c", "instruction": "i", "answer": "a"})
    data.write_text("\n".join(lines) + "\n")
    _assert_fails_cleanly(["eval", "--data", str(data), "--models", str(models)], tmp_path / "o", capsys,
                          f"{data}:2: unknown agent 'poet'")


def test_eval_malformed_line(models, data, tmp_path, capsys):
    data.write_text(data.read_text() + "{oops\n")
    n = len(data.read_text().splitlines())
    _assert_fails_cleanly(["eval", "--data", str(data), "--models", str(models)], tmp_path / "o", capsys,
                          f"{data}:{n}: not valid JSON")


def test_eval_checkpoint_without_manifest(models, data, tmp_path, capsys):
    copy = tmp_path / "models"
    shutil.copytree(models, copy)
    (copy / "baselines" / "fullft" / "route" / "prefillshare.json").unlink()
    _assert_fails_cleanly(["eval", "--data", str(data), "--models", str(copy)], tmp_path / "o", capsys,
                          f"{copy / 'baselines' / 'fullft' / 'route'}: no prefillshare.json")


def test_eval_decoder_base_mismatch(models, data, tmp_path, capsys):
    copy = tmp_path / "models"
    shutil.copytree(models, copy)
    other = save_random_model(tmp_path / "otherbase", TOKENIZER, seed=99)
    write_manifest(copy / "decoders" / "lookup", _manifest(other, "lookup", "cache_conditioned"))
    _assert_fails_cleanly(["eval", "--data", str(data), "--models", str(copy)], tmp_path / "o", capsys,
                          f"{copy / 'decoders' / 'lookup'}: cannot consume the base's KV",
                          f"trained on prefill module {prefill_module_id(other)}")
