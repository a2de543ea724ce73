"""Prompt rendering: training and serving build the same token ids; unreproducible renderings are refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from prefillshare.app.config import load_config
from prefillshare.app.models.manifest import (
    MANIFEST_NAME,
    DecodeManifest,
    ManifestError,
    PromptFormat,
    read_manifest,
    write_manifest,
)
from prefillshare.app.rendering import Renderer, RenderError, template_sha256
from prefillshare.app.training.tasks import render_prompt
from prefillshare.deployments.prompts import Prompter, common_prefix

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "checkpoints" / "tokenizer"
CHATML = ROOT / ".venv/lib/python3.11/site-packages/vllm/transformers_utils/chat_templates/template_chatml.jinja"
SYSTEM = "You answer questions about one order record."


def _decoder(tmp: Path, name: str, renderer: Renderer | None) -> Path:
    """A decoder directory holding what the Prompter reads: the manifest and the template file."""
    d = tmp / name
    d.mkdir(parents=True)
    fmt = renderer.fmt if renderer else Renderer().fmt
    write_manifest(d, DecodeManifest(name, "pm-0", "tok-0", {"method": "cache_conditioned"}, prompt=fmt))
    for fname, text in (renderer.extra_files() if renderer else {}).items():
        (d / fname).write_text(text)
    return d


def _config(tmp: Path, decoders: dict[str, Path]):
    return load_config({"tokenizer": str(TOKENIZER),
                        "prefill_modules": [{"name": "base", "model": str(ROOT / "checkpoints" / "base")}],
                        "decoders": [{"name": n, "model": str(p)} for n, p in decoders.items()]})


@pytest.fixture(scope="module")
def chatml() -> Renderer:
    """A decoder trained system-first (as every decoder before the shared-first layout was)."""
    return Renderer.chat(CHATML.read_text(), system=SYSTEM, layout="system_first")


@pytest.fixture(scope="module")
def shared_first() -> Renderer:
    return Renderer.chat(CHATML.read_text(), system=SYSTEM, layout="shared_first")


def test_prompter_without_renderers_keeps_the_suite_rendering():
    p = Prompter(str(TOKENIZER))
    want = p.encode(render_prompt("order\ncity: rome", "Q: which hub ships to the\ncity"))
    assert p.agent_prompt("order\ncity: rome", "Q: which hub ships to the\ncity") == want
    assert p.agent_prompt("order\ncity: rome", "Q: which hub ships to the\ncity", model="unknown") == want
    assert p.chat_prompt([("system", "order\ncity: rome"), ("user", "Q: which hub ships to the\ncity")]) == want


def test_each_decoder_renders_its_recorded_format_and_agents_share_the_context(tmp_path, chatml):
    cfg = _config(tmp_path, {"chat-a": _decoder(tmp_path, "chat-a", chatml),
                             "chat-b": _decoder(tmp_path, "chat-b", chatml),
                             "plain": _decoder(tmp_path, "plain", None)})
    p = Prompter.from_config(cfg)
    ctx = "order\ncity: rome\nitem: lamp"
    a, b = p.agent_prompt(ctx, "Q: what is the\nitem", "chat-a"), p.agent_prompt(ctx, "Q: what is the\ncity", "chat-b")
    text = p.tok.decode(a)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{ctx}")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    shared = common_prefix([a, b])
    assert p.tok.decode(shared).startswith(text[: text.index(ctx) + len(ctx)])  # the whole context is shared
    assert p.agent_prompt(ctx, "Q: what is the\nitem", "plain") == p.encode(render_prompt(ctx, "Q: what is the\nitem"))
    messages = [("system", SYSTEM), ("user", "hello"), ("assistant", "hi"), ("user", "again")]
    want = list(p.tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], chat_template=chatml.template,
                                          add_generation_prompt=True, tokenize=True, return_dict=False))
    assert p.chat_prompt(messages, "chat-a") == want


def test_training_ids_of_a_conversation_are_the_serving_prompt_plus_the_answer(chatml):
    p = Prompter(str(TOKENIZER), {"d": chatml})
    convo = [("system", SYSTEM), ("user", "order\ncity: rome\nQ: what is the\ncity"), ("assistant", "rome")]
    prompt, response = chatml.training_ids(p.tok, convo)
    assert prompt == p.chat_prompt(convo[:-1], "d")
    assert p.tok.decode(response) == "rome</s>" and response[-1] == p.eos_token_id


def test_deploy_refuses_a_template_with_another_hash(tmp_path, chatml):
    d = _decoder(tmp_path, "chat", chatml)
    (d / "chat_template.jinja").write_text(chatml.template.replace("assistant", "bot"))
    with pytest.raises(RenderError, match=r"decoders\[0\] \(chat\): .*chat_template.jinja: unknown template"):
        Prompter.from_config(_config(tmp_path, {"chat": d}))
    shutil.rmtree(d)
    d = _decoder(tmp_path, "chat", chatml)
    (d / "chat_template.jinja").unlink()
    with pytest.raises(RenderError, match=r"decoders\[0\] \(chat\): .*template_file 'chat_template.jinja' is not in"):
        Prompter.from_config(_config(tmp_path, {"chat": d}))


@pytest.mark.parametrize("template, problem", [
    ("{% for m in messages %}{{ m.content }", "does not render"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% endif %}{% endfor %}",
     "not render the final assistant turn as a continuation"),
])
def test_deploy_refuses_a_template_that_does_not_render(tmp_path, template, problem):
    d = _decoder(tmp_path, "bad", Renderer.chat(template))
    with pytest.raises(RenderError, match=r"decoders\[0\] \(bad\): ") as err:
        Prompter.from_config(_config(tmp_path, {"bad": d}))
    assert problem in str(err.value)


def test_template_hash_is_over_the_exact_text(chatml):
    assert chatml.fmt.template_sha256 == template_sha256(CHATML.read_text())
    with pytest.raises(RenderError, match="does not match the recorded"):
        Renderer(chatml.fmt, chatml.template + " ")


CONTEXT = "order\ncity: rome\nitem: lamp\nqty: 2\nday: tue\nnote: leave at the side door please"
AGENTS = {"city-agent": "You find the city of an order.", "count-agent": "You count the items of an order."}


def _framework_prompts(p: Prompter, model: str, tools_line: str | None = None) -> list[list[int]]:
    """What an agent framework sends for each agent: its own system prompt first, then the shared turn."""
    return [p.chat_prompt([("system", system), ("user", CONTEXT)], model, tools_line=tools_line)
            for system in AGENTS.values()]


def test_shared_first_moves_each_agents_own_text_after_the_shared_conversation(shared_first):
    messages = [("system", "S1"), ("user", "u1"), ("assistant", "a1"), ("developer", "D"), ("user", "u2"),
                ("assistant", "call"), ("tool", "result")]
    arranged = shared_first.arrange(messages, tools_line="tools: ship(item)")
    # every text still reaches the decoder; only the agent's own turns moved, after the last user turn
    assert arranged == [("user", "u1"), ("assistant", "a1"), ("user", "u2\nS1\nD\ntools: ship(item)"),
                        ("assistant", "call"), ("tool", "result")]
    assert shared_first.arrange([("user", "u")]) == [("user", "u")]
    assert shared_first.arrange([("system", "S"), ("tool", "r")]) == [("user", "S"), ("tool", "r")]
    # system-first keeps the messages as sent; tools come first as a system turn (as before the layout)
    system_first = Renderer.chat(shared_first.template, layout="system_first")
    assert system_first.arrange(messages, tools_line="T") == [("system", "T"), *messages]


@pytest.mark.parametrize("tools_line", [None, "tools: ship(item, qty): ships an order"])
def test_agents_with_their_own_system_prompts_share_the_context_only_when_shared_first(shared_first, chatml,
                                                                                       tools_line):
    p = Prompter(str(TOKENIZER), {"new": shared_first, "old": chatml})
    context_ids = p.encode(CONTEXT, add_special_tokens=False)
    new = _framework_prompts(p, "new", tools_line)
    assert len(common_prefix(new)) >= len(context_ids)  # the whole shared turn, template header included
    text = p.tok.decode(new[0])
    assert text.index(CONTEXT) < text.index(AGENTS["city-agent"])  # the agent's text comes after the context
    assert tools_line is None or text.index(AGENTS["city-agent"]) < text.index(tools_line)
    old = _framework_prompts(p, "old", tools_line)
    assert "city: rome" not in p.tok.decode(common_prefix(old))  # system-first: they part before the context


def test_shared_first_training_ids_are_the_serving_ids_for_chat_and_agent_requests(shared_first):
    p = Prompter(str(TOKENIZER), {"d": shared_first})
    question = "Q: what is the\ncity"
    convo = [("system", SYSTEM), ("user", f"{CONTEXT}\n{question}"), ("assistant", "rome")]
    prompt, response = shared_first.training_ids(p.tok, convo)
    assert prompt == p.chat_prompt(convo[:-1], "d")
    assert p.tok.decode(response) == "rome</s>"
    # an agent run's request is the framework's shape: the agent's system prompt and its question are its
    # own text, the context the shared turn; the question's last token stays the prompt's last token
    agent = p.agent_prompt(CONTEXT, question, "d")
    assert agent == shared_first.training_ids(p.tok, [("system", f"{SYSTEM}\n{question}"), ("user", CONTEXT),
                                                      ("assistant", "rome")])[0]
    assert p.tok.decode(agent).rstrip().endswith(f"{CONTEXT}\n{SYSTEM}\n{question}<|im_end|>\n<|im_start|>assistant")
    other = p.agent_prompt(CONTEXT, "Q: what is the\nitem", "d")
    assert len(common_prefix([agent, other])) >= len(p.encode(CONTEXT, add_special_tokens=False))


def test_a_suite_decoder_shared_first_without_system_prompt_renders_as_before():
    p = Prompter(str(TOKENIZER), {"s": Renderer(PromptFormat(layout="shared_first"))})
    question = "Q: which hub ships to the\ncity"
    assert p.agent_prompt(CONTEXT, question, "s") == p.encode(render_prompt(CONTEXT, question))
    with_system = Prompter(str(TOKENIZER), {"s": Renderer(PromptFormat(system="Route it.", layout="shared_first"))})
    assert with_system.agent_prompt(CONTEXT, question, "s") == p.encode(f"{CONTEXT}\nRoute it.\n{question}")


def test_a_manifest_records_the_layout_and_one_without_it_was_trained_system_first(tmp_path, shared_first):
    d = _decoder(tmp_path, "new", shared_first)
    assert read_manifest(d).prompt.layout == "shared_first"
    data = json.loads((d / MANIFEST_NAME).read_text())
    del data["prompt"]["layout"]
    (d / MANIFEST_NAME).write_text(json.dumps(data))
    assert read_manifest(d).prompt.layout == "system_first"
    data["prompt"]["layout"] = "own_first"
    (d / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="prompt.layout must be one of shared_first, system_first"):
        read_manifest(d)
