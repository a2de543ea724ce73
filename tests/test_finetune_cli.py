"""`prefillshare train` on a user's own base, agents and data: formats, names, tokenizers, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from random_checkpoint import save_random_model

from prefillshare.app.cli import main as cli
from prefillshare.app.models.compat import check
from prefillshare.app.models.manifest import read_manifest
from prefillshare.app.rendering import Renderer
from prefillshare.app.training import tasks
from prefillshare.app.training.data import read_records, render_records, truncate
from prefillshare.app.training.tokenizer import load_tokenizer
from prefillshare.deployments.prompts import Prompter

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "checkpoints" / "tokenizer"
SITE = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
CHATML = SITE / "vllm" / "transformers_utils" / "chat_templates" / "template_chatml.jinja"
SENTENCEPIECE = SITE / "mistral_common" / "data" / "tokenizer.model.v1"  # Llama/Mistral v1 vocab, no pad token
AGENT = "prüf-ágent-1"
FAST = ["--steps", "2", "--batch-size", "4", "--no-progress"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("ft") / "base", TOKENIZER, seed=5, num_hidden_layers=2)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def _conversations(n: int, agent_key: str = "task", agents=(AGENT, "other")) -> list[dict]:
    rows = []
    for i, e in enumerate(tasks.make_examples(n, seed=3)[: 2 * n]):
        rows.append({agent_key: agents[i % len(agents)], "messages": [
            {"role": "system", "content": "Answer from the record."},
            {"role": "user", "content": tasks.render_prompt(e.context, e.instruction)},
            {"role": "assistant", "content": e.answer}]})
    return rows


def test_chat_data_any_agent_name_lora_exports_merged_and_adapter_with_rendering(base, tmp_path, capsys):
    data = _write(tmp_path / "chat.jsonl", _conversations(6))
    out = tmp_path / "dec"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", AGENT, "--agent-field", "task",
                "--chat-template", str(CHATML), "--lora", "--lora-rank", "4", "--out", str(out), *FAST]) == 0
    assert f"agent {AGENT!r}" in capsys.readouterr().out
    merged, adapter = read_manifest(out), read_manifest(tmp_path / "dec-adapter")
    for m in (merged, adapter):
        assert m.agent == AGENT and m.prompt.format == "chat_template"
        assert m.prompt.system == "Answer from the record."  # every conversation's system prompt
        assert m.training["lr"] == 2e-4 and m.training["lora"]  # the LoRA default learning rate
    assert adapter.adapter.rank == 4 and (tmp_path / "dec-adapter" / "adapter_config.json").is_file()
    assert check(base, out).shared and check(base, tmp_path / "dec-adapter").shared
    assert not (tmp_path / "dec.state").exists()
    # the ids training used are the ids the Router's Prompter builds for the same conversation
    tok = load_tokenizer(base)
    renderer = Renderer.for_decoder(out)
    records = read_records(data, AGENT, "task")
    prompter = Prompter(str(base), {AGENT: renderer})
    for rec, enc in zip(records, render_records(records, tok, renderer)):
        assert list(enc.prompt) == prompter.chat_prompt(rec.messages[:-1], model=AGENT)
        assert tok.decode(enc.response).endswith("</s>")
    # the name goes into the app config as the served decoder's name; the Prompter the app builds
    # from it renders agent requests the way training rendered them
    from prefillshare.app.config import load_config

    cfg = load_config({"tokenizer": str(base), "prefill_modules": [{"name": "base", "model": str(base)}],
                       "decoders": [{"name": AGENT, "model": str(out)}]})
    served = Prompter.from_config(cfg)
    # a line of the messages file sent as an OpenAI chat request (content as text parts) goes through the
    # Router's request parsing and turn extraction to the same ids training used for that line
    from prefillshare.deployments.ingress.schemas import ChatBody, parse
    from prefillshare.deployments.ingress.tools import turns

    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    for row, enc in zip([r for r in rows if r["task"] == AGENT], render_records(records, tok, renderer), strict=True):
        *prompt_msgs, _ = row["messages"]
        request = {"model": AGENT, "messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                                                for m in prompt_msgs]}
        body = parse(json.dumps(request).encode(), ChatBody)
        assert served.chat_prompt(turns(body.messages), model=body.model) == list(enc.prompt)
    # an agent run is rendered as a framework sends it, in the layout trained (shared-first by default):
    # the agent's system prompt and question are its own text after the shared context
    assert merged.prompt.layout == "shared_first"
    context, question = tasks.make_examples(1, seed=3)[0].context, "Q: what is the\ncity"
    assert served.agent_prompt(context, question, model=AGENT) == renderer.training_ids(
        tok, [("system", f"Answer from the record.\n{question}"), ("user", context), ("assistant", "x")])[0]


def test_invocation_writes_pefts_activated_lora_form_that_peft_loads_and_the_app_serves_in_engine(base, tmp_path,
                                                                                                  capsys):
    """--invocation: the adapter alone, in PEFT's aLoRA form, trained from the invocation on over the
    base's KV of what precedes it (the split the engine serves), and no merged model."""
    from peft import PeftModel

    from prefillshare.app.config import load_config
    from prefillshare.app.models.checkpoint import load_model
    from prefillshare.app.plan import plan_app
    from prefillshare.app.prompt_split import Activation
    from prefillshare.app.training.batches import Encoded, collate

    data = _write(tmp_path / "chat.jsonl", _conversations(6))
    out = tmp_path / "check"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", AGENT, "--agent-field", "task",
                "--lora", "--lora-rank", "4", "--invocation", "<|check|>", "--out", str(out), *FAST]) == 0
    tok = load_tokenizer(base)
    invocation = tok.encode("<|check|>", add_special_tokens=False)
    peft_cfg = json.loads((out / "adapter_config.json").read_text())
    assert peft_cfg["alora_invocation_tokens"] == invocation and peft_cfg["task_type"] == "CAUSAL_LM"
    assert not (out / "config.json").exists() and not (tmp_path / "check-adapter").exists()  # nothing merged
    manifest = read_manifest(out)
    assert manifest.method == "cache_conditioned" and manifest.training["invocation"] == invocation
    loaded = PeftModel.from_pretrained(load_model(base), out)
    assert loaded.peft_config["default"].alora_invocation_tokens == invocation
    assert Activation.of_adapter(out) == Activation(tuple(invocation))
    # training split each prompt at the invocation: the adapter's own tokens start with it
    batch = collate([Encoded(AGENT, (1, 5, 6, *invocation, 9), (7, 2))], 0, Activation(tuple(invocation)))
    assert batch.prefix_ids[0].tolist() == [1, 5, 6] and batch.own_ids[0].tolist()[:len(invocation)] == invocation
    cfg = load_config({"tokenizer": str(base), "prefill_modules": [
        {"name": "base", "model": str(base), "max_lora_rank": 8,
         "lora_decoders": [{"name": AGENT, "path": str(out), "rank": 4}]}]})
    (served,) = plan_app(cfg).decoders
    assert served.in_engine and served.name == AGENT
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", AGENT, "--agent-field", "task",
                "--invocation", "<|check|>", "--out", str(tmp_path / "full"), *FAST]) != 0
    assert "--invocation needs --lora" in capsys.readouterr().err


def test_layout_system_first_is_recorded_and_served_in_the_order_sent(base, tmp_path):
    data = _write(tmp_path / "chat.jsonl", _conversations(4))
    out = tmp_path / "old"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", AGENT, "--agent-field", "task",
                "--chat-template", str(CHATML), "--layout", "system-first", "--out", str(out), *FAST]) == 0
    assert read_manifest(out).prompt.layout == "system_first"
    served = Prompter(str(base), {AGENT: Renderer.for_decoder(out)})
    context, question = tasks.make_examples(1, seed=3)[0].context, "Q: what is the\ncity"
    text = served.decode(served.agent_prompt(context, question, model=AGENT))
    # the system prompt first, then the context and the question in the user turn, as before the layout
    assert text.index("Answer from the record.") < text.index(context) < text.index(question)


def test_agent_field_splits_one_file_into_decoders(base, tmp_path):
    data = _write(tmp_path / "chat.jsonl", _conversations(4, agent_key="role_of"))
    out = tmp_path / "decs"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent-field", "role_of",
                "--method", "full_ft", "--out", str(out), *FAST]) == 0
    assert {p.name for p in out.iterdir()} == {AGENT, "other"}
    assert read_manifest(out / AGENT).training["lr"] == 1e-5  # the full-parameter default
    assert read_manifest(out / AGENT).prompt.format == "suite"  # no template given, none in the tokenizer


def test_prompt_completion_data_and_max_length_keep_the_last_token_and_answer(base, tmp_path):
    tok = load_tokenizer(base)
    rows = [{"prompt": "order\ncity: rome\nitem: lamp\nnote: " + "ring twice " * 20 + "\nQ: what is the\ncity",
             "completion": " rome"}]
    data = _write(tmp_path / "pc.jsonl", rows)
    records = read_records(data, agent="x")
    renderer = Renderer(read_manifest_prompt("text"))
    full = render_records(records, tok, renderer)[0]
    short = render_records(records, tok, renderer, max_length=20)[0]
    assert len(short.prompt) + len(short.response) == 20 and short.response == full.response
    assert short.prompt[0] == tok.bos_token_id and short.prompt[1:] == full.prompt[-(19 - len(full.response)):]
    assert short.prompt[-1] == full.prompt[-1]
    out = tmp_path / "dec"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent", "x", "--max-length", "20",
                "--out", str(out), *FAST]) == 0
    m = read_manifest(out)
    assert m.prompt.format == "text" and m.training["max_length"] == 20


def read_manifest_prompt(fmt: str):
    from prefillshare.app.models.manifest import PromptFormat

    return PromptFormat(fmt)


def test_truncate_refuses_an_answer_that_cannot_fit():
    with pytest.raises(tasks.DataError, match="f.jsonl:3: the answer \\(5 tokens\\) does not fit --max-length 5"):
        truncate([1, 7, 8, 9], [4, 4, 4, 4, 2], 5, 1, "f.jsonl:3")


def test_a_tokenizer_without_pad_token_trains(tmp_path):
    """A real Llama/Mistral sentencepiece vocabulary (32k, no pad token) on a small Llama."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = tmp_path / "sp"
    src.mkdir()
    (src / "tokenizer.model").write_bytes(SENTENCEPIECE.read_bytes())
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tok = AutoTokenizer.from_pretrained(str(src))
    assert tok.pad_token is None and tok.eos_token_id is not None and len(tok) == 32000
    base = tmp_path / "llama"
    tok.save_pretrained(str(base))
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id, pad_token_id=None)).save_pretrained(str(base))
    data = _write(tmp_path / "chat.jsonl", _conversations(4))
    out = tmp_path / "dec"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent-field", "task", "--agent", "other",
                "--chat-template", str(CHATML), "--out", str(out), "--gradient-checkpointing", *FAST]) == 0
    assert read_manifest(out).agent == "other" and (out / "chat_template.jinja").is_file()


# --- bad input: one clear error naming file, line and field; nothing written ---
GOOD_CHAT = {"agent": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]}


@pytest.mark.parametrize("rows, problem", [
    ([GOOD_CHAT, {"agent": "a", "messages": [{"role": "user", "content": "q"}]}],
     ":2: field 'messages[0].role': the conversation does not end with an assistant turn"),
    ([GOOD_CHAT, {"agent": "a", "messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "x"}]}],
     ":2: field 'messages[1].role' must be one of system, user, assistant"),
    ([GOOD_CHAT, {"agent": "a", "messages": [{"role": "user", "content": 1}, {"role": "assistant", "content": "x"}]}],
     ":2: field 'messages[0].content' must be a string"),
    ([{"agent": "a", "prompt": "p"}], ":1: missing field 'completion'"),
    ([{"agent": "a", "context": "c", "answer": "x"}], ":1: missing field 'instruction'"),
    ([GOOD_CHAT, {"agent": "a", "prompt": "p", "completion": "c"}], ":2: a text line in a file whose line 1 is messages"),
    ([{"messages": GOOD_CHAT["messages"]}], ":1: missing field 'agent' (the agent; or pass --agent NAME)"),
    ([GOOD_CHAT, "{oops"], ":2: not valid JSON"),
])
def test_bad_data_names_file_line_and_field(base, tmp_path, capsys, rows, problem):
    data = _write(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "dec"
    assert cli(["train", "--base", str(base), "--data", str(data), "--out", str(out), *FAST]) == 2
    assert f"{data}{problem}" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "dec.state").exists()


def test_base_without_config_and_unrenderable_template_fail_cleanly(base, tmp_path, capsys):
    data = _write(tmp_path / "chat.jsonl", [GOOD_CHAT])
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "dec"
    assert cli(["train", "--base", str(empty), "--data", str(data), "--out", str(out), *FAST]) == 2
    assert f"{empty}: no config.json" in capsys.readouterr().err
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    assert cli(["train", "--base", str(base), "--data", str(data), "--chat-template", str(bad), "--out", str(out),
                *FAST]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: the tokenizer cannot render it: chat template does not render" in err
    assert not out.exists()


def test_eval_by_path_refuses_a_decoder_of_another_base(base, tmp_path, capsys):
    data = _write(tmp_path / "chat.jsonl", _conversations(2))
    dec = tmp_path / "dec"
    assert cli(["train", "--base", str(base), "--data", str(data), "--agent-field", "task", "--agent", "other",
                "--out", str(dec), *FAST]) == 0
    other = save_random_model(tmp_path / "other", TOKENIZER, seed=6, num_hidden_layers=2)
    out = tmp_path / "res"
    assert cli(["eval", "--base", str(other), "--decoder", str(dec), "--data", str(data), "--agent-field", "task",
                "--out", str(out)]) == 2
    assert f"{dec}: cannot consume the base's KV: decoder was trained on prefill module" in capsys.readouterr().err
    assert not out.with_suffix(".json").exists()
    assert cli(["eval", "--base", str(base), "--decoder", str(dec), "--data", str(data), "--agent-field", "task",
                "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["methods"] == ["base", "prefillshare"] and list(result["agents"]) == ["other"]
    assert result["agents"]["other"]["prefillshare"]["n"] == 2
