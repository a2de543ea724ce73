"""Prompt rendering: training and serving build the same token ids; unreproducible renderings are refused."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.config import load_config
from app.models.manifest import DecodeManifest, write_manifest
from app.rendering import Renderer, RenderError, template_sha256
from app.training.tasks import render_prompt
from deployments.prompts import Prompter, common_prefix

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
    return Renderer.chat(CHATML.read_text(), system=SYSTEM)


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
