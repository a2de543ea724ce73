"""vLLM's request extensions without an engine: what each field becomes in vLLM's SamplingParams,
in the prompt ids, in the KV salt and in the answer's shape. Their effect on real engines is
tests/keyless_app/test_vllm_compat.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from prefillshare.app.config import LimitsConfig
from prefillshare.app.sampling import Sampling, TokenLogprob, TopLogprob, private_prefill_reason, to_sampling_params
from prefillshare.deployments.errors import ApiError
from prefillshare.deployments.ingress.prompt_options import (
    cache_salt,
    chat_switches,
    chat_turns,
    prompt_logprobs_of,
    truncated,
)
from prefillshare.deployments.ingress.request_options import check_unsupported, sampling_from
from prefillshare.deployments.ingress.schemas import AgentBody, ChatBody, CompletionBody

ROOT = Path(__file__).resolve().parent.parent

LIMITS = LimitsConfig(max_tokens_default=8, max_tokens_cap=64)
EOS = 2


def _sampling(**fields) -> Sampling:
    return sampling_from(CompletionBody(model="m", prompt="p", **fields), LIMITS, EOS, 1000)


def test_sampling_extensions_reach_vllm_sampling_params():
    p = to_sampling_params(_sampling(min_tokens=3, stop_token_ids=[7, 9], include_stop_str_in_output=True, skip_special_tokens=False,
                  spaces_between_special_tokens=False, bad_words=["lamp"], allowed_token_ids=[5, 6, 7]))
    assert (p.min_tokens, p.stop_token_ids, p.include_stop_str_in_output, p.skip_special_tokens,
            p.spaces_between_special_tokens, p.bad_words, p.allowed_token_ids) == \
        (3, [EOS, 7, 9], True, False, False, ["lamp"], [5, 6, 7])
    # ignore_eos: eos leaves the stop ids (the app stops on eos through them), the engine ignores it
    p = to_sampling_params(_sampling(ignore_eos=True, stop_token_ids=[7]))
    assert (p.ignore_eos, p.stop_token_ids) == (True, [7])
    assert to_sampling_params(_sampling()).stop_token_ids == [EOS]


@pytest.mark.parametrize("so, kind", [({"choice": ["yes", "no"]}, "choice"), ({"regex": "[a-z]{3}"}, "regex"),
                                      ({"grammar": 'root ::= "a" | "b"'}, "grammar"),
                                      ({"json": {"type": "object"}}, "json"), ({"json_object": True}, "json_object")])
def test_structured_outputs_of_each_kind_become_vllms(so, kind):
    got = to_sampling_params(_sampling(structured_outputs=so)).structured_outputs
    want = {"json": '{"type": "object"}', "json_object": True}.get(kind, so.get(kind))
    assert getattr(got, kind) == want


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"priority": 1}, "priority"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [5000]}, "stop_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_bad_extension_values_get_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as e:
        _sampling(**fields)
    assert (e.value.status, e.value.param) == (400, param)


def test_extensions_apply_per_agent_with_the_agents_prefix():
    s = sampling_from(AgentBody(model="m", instruction="i", ignore_eos=True, min_tokens=2,
                                structured_outputs={"choice": ["x"]}), LIMITS, EOS, 1000, prefix="agents[0].")
    assert (s.ignore_eos, s.min_tokens, s.structured.choice) == (True, 2, ("x",))
    with pytest.raises(ApiError) as e:
        sampling_from(AgentBody(model="m", instruction="i", priority=3), LIMITS, EOS, 1000, prefix="agents[0].")
    assert e.value.param == "agents[0].priority"


@pytest.mark.parametrize("field, value", [("guided_json", {"type": "object"}), ("guided_choice", ["a"]),
                                          ("chat_template", "{{ x }}"), ("use_beam_search", True),
                                          ("kv_transfer_params", {"do_remote_prefill": True})])
def test_extensions_that_cannot_hold_here_are_refused_by_name(field, value):
    with pytest.raises(ApiError) as e:
        check_unsupported(ChatBody(model="m", messages=[{"role": "user", "content": "hi"}], **{field: value}))
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported_parameter")
    check_unsupported(ChatBody(model="m", messages=[{"role": "user", "content": "hi"}], use_beam_search=False))


def test_prompt_logprobs_ask_for_a_private_prefill():
    body = CompletionBody(model="m", prompt="p", prompt_logprobs=2)
    s = sampling_from(body, LIMITS, EOS, 1000, prompt_logprobs=prompt_logprobs_of(body, None))
    assert (private_prefill_reason(s), to_sampling_params(s).prompt_logprobs) == ("prompt_logprobs", 2)
    assert private_prefill_reason(_sampling()) is None
    assert prompt_logprobs_of(CompletionBody(model="m", prompt="p", echo=True, logprobs=1), 1) == 1
    assert prompt_logprobs_of(CompletionBody(model="m", prompt="p", logprobs=1), 1) is None
    with pytest.raises(ApiError) as e:
        prompt_logprobs_of(CompletionBody(model="m", prompt="p", prompt_logprobs=1, stream=True), None)
    assert e.value.param == "prompt_logprobs"


def test_request_cache_salt_joins_the_tenant_salt_never_replaces_it():
    assert cache_salt(None, None) is None
    assert cache_salt("tenant-a", None) == "tenant-a"
    assert cache_salt(None, "mine") == "mine"
    joined = {cache_salt(t, "mine") for t in ("tenant-a", "tenant-b")}
    assert len(joined) == 2 and not joined & {"mine", "tenant-a", "tenant-b"}


def test_truncate_prompt_tokens_keeps_the_side_vllm_keeps():
    ids = list(range(10))
    body = lambda **kw: CompletionBody(model="m", prompt="p", **kw)  # noqa: E731
    assert truncated(ids, body(truncate_prompt_tokens=4), 100, 8) == [6, 7, 8, 9]
    assert truncated(ids, body(truncate_prompt_tokens=4, truncation_side="right"), 100, 8) == [0, 1, 2, 3]
    assert truncated(ids, body(truncate_prompt_tokens=-1), 12, 8) == [6, 7, 8, 9]
    assert truncated(ids, body(), 100, 8) == ids
    with pytest.raises(ApiError) as e:
        truncated(ids, body(truncate_prompt_tokens=95), 100, 8)
    assert e.value.param == "truncate_prompt_tokens"


def test_chat_switches_and_continue_final_message():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]
    body = ChatBody(model="m", messages=msgs, continue_final_message=True, add_generation_prompt=False)
    assert chat_turns(body) == [("user", "hi"), ("assistant", "hel")]
    assert chat_switches(body)["continue_final_message"] is True
    with pytest.raises(ApiError) as e:
        chat_switches(ChatBody(model="m", messages=msgs, continue_final_message=True))
    assert e.value.param == "continue_final_message"
    with pytest.raises(ApiError):
        chat_turns(ChatBody(model="m", messages=msgs[:1], continue_final_message=True, add_generation_prompt=False))


def test_chat_template_switches_render_through_the_decoders_template():
    from transformers import AutoTokenizer

    from bench.random_models import TOKENIZER
    from prefillshare.app.rendering import Renderer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not (loop.last and continue_final_message"
                " is defined and continue_final_message) %}</{{ m.role }}>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}{% if shout %}!{% endif %}")
    r = Renderer.chat(template)
    msgs = [("user", "hi")]
    text = lambda ids: tok.decode(ids)  # noqa: E731
    assert text(r.chat_ids(tok, msgs)).endswith("</user><assistant>")
    assert text(r.chat_ids(tok, msgs, add_generation_prompt=False)).endswith("</user>")
    assert text(r.chat_ids(tok, msgs, template_kwargs={"shout": True})).endswith("<assistant>!")
    cont = r.chat_ids(tok, [*msgs, ("assistant", "hel")], add_generation_prompt=False, continue_final_message=True)
    assert text(cont).endswith("<assistant>hel")


def test_a_chat_switch_a_decoders_rendering_would_ignore_is_refused_naming_the_field():
    """Honoured where the rendering reads it (above), refused where it would change nothing: the
    shipped chat adapters' template has no generation prompt, the suite format no template."""
    from transformers import AutoTokenizer

    from bench.random_models import TOKENIZER
    from prefillshare.app.rendering import Renderer, SwitchIgnored

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    chat = Renderer.for_decoder(ROOT / "checkpoints" / "chat" / "adapters" / "lookup")
    assert "add_generation_prompt" not in chat.template_variables
    msgs = [("user", "order\ncity: oslo"), ("user", "what is the city?")]
    for renderer in (chat, Renderer()):
        with pytest.raises(SwitchIgnored, match="add_generation_prompt: false has no effect") as e:
            renderer.chat_ids(tok, msgs, add_generation_prompt=False)
        assert e.value.field == "add_generation_prompt"
        with pytest.raises(SwitchIgnored, match=r"chat_template_kwargs.enable_thinking: .* does not read") as e:
            renderer.chat_ids(tok, msgs, template_kwargs={"enable_thinking": False})
        assert e.value.field == "chat_template_kwargs.enable_thinking"
        # continue_final_message needs add_generation_prompt off, whatever the template reads
        renderer.chat_ids(tok, [*msgs, ("assistant", "os")], add_generation_prompt=False, continue_final_message=True)
    shout = Renderer.chat("{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!{% endif %}")
    assert shout.template_variables == {"messages", "shout"}
    shout.chat_ids(tok, msgs, template_kwargs={"shout": True})


def test_answer_shapes_token_ids_and_echoed_prompt_logprobs():
    from prefillshare.deployments.ingress.openai_format import Answer
    from prefillshare.deployments.messages import CompletionJob, DecodeChunk
    from prefillshare.deployments.path.decode_call import Output

    job = CompletionJob("cmpl-1", "m", (1, 5, 6), Sampling(max_tokens=2))
    plp = [None, TokenLogprob(5, "a", -1.0, (TopLogprob(5, "a", -1.0, 1),), 1),
           TokenLogprob(6, "b", -2.0, (TopLogprob(9, "z", -0.5, 1),), 2)]
    gen = [TokenLogprob(7, "c", -0.1, (), 1)]
    a = Answer(job, chat=False, output=Output(), echo="<s>ab", logprobs=True, token_ids=True, first_token="<s>")
    a.output.add(DecodeChunk("cmpl-1", "m", "c", [7], True, "length", logprobs=gen, prompt_logprobs=plp))
    c = a.choice(0)
    assert (c["prompt_token_ids"], c["token_ids"], c["text"]) == ([1, 5, 6], [7], "<s>abc")
    assert c["logprobs"]["tokens"] == ["<s>", "a", "b", "c"]
    assert c["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -0.1]
    assert c["prompt_logprobs"][0] is None and c["prompt_logprobs"][2]["6"]["rank"] == 2
    assert set(c["prompt_logprobs"][2]) == {"6", "9"}
    ids = Answer(job, chat=True, output=Output(), logprobs=True, tokens_as_ids=True)
    ids.output.add(DecodeChunk("cmpl-1", "m", "c", [7], True, "length", logprobs=gen))
    assert ids.choice(0)["logprobs"]["content"][0]["token"] == "token_id:7"


def test_streamed_chunks_carry_token_ids_and_the_prompt_ids_once():
    import json

    from prefillshare.deployments.ingress.openai_format import Answer
    from prefillshare.deployments.messages import CompletionJob, DecodeChunk
    from prefillshare.deployments.path.decode_call import Output

    job = CompletionJob("c", "m", (1, 5), Sampling(max_tokens=2))
    for chat in (False, True):
        a = Answer(job, chat=chat, output=Output(), token_ids=True)
        events = []
        for i, (text, tid) in enumerate((("x", 7), ("y", 8))):
            chunk = DecodeChunk("c", "m", text, [tid], i == 1, "length" if i == 1 else None)
            a.output.add(chunk)
            events.append(json.loads(a.delta_event(chunk, first=i == 0)[len("data: "):]))
        assert [e["choices"][0]["token_ids"] for e in events] == [[7], [8]]
        where = (lambda e: e.get("prompt_token_ids")) if chat else (lambda e: e["choices"][0].get("prompt_token_ids"))
        assert [where(e) for e in events] == [[1, 5], None]
