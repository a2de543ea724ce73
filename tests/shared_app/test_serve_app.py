"""The Serve application end to end, what it does: the OpenAI surface, fan-outs, metrics, the
bad-input matrix, API keys and tenants, a soak smoke. Real vLLM engines, the real connector, over
HTTP, on the package's app (tests/serve_test_app.py, tests/shared_app/conftest.py). Its faults
(killed replicas, overload, disconnecting clients) are in test_serve_faults.py, on the same app,
which every engine answers before this module's first test.
Run through scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from serve_test_app import (
    _AGENT,
    _OK,
    CONTEXT,
    KEY_A,
    KEY_B,
    MAX_BODY,
    MAX_LOGPROBS,
    MAX_N,
    MAX_NEW,
    _auth,
    _expected,
    _get,
    _metric,
    _metrics,
    _post,
)

pytestmark = [pytest.mark.serve, pytest.mark.engine]


# --- tests -----------------------------------------------------------------------------
def test_openai_client_lists_models_completes_and_streams_each_decoder(app, client, reference):
    from prefillshare.app.training.tasks import render_prompt

    ids = {m.id for m in client.models.list().data}
    assert ids == {"alpha", "beta", "gamma"}
    tok, _ = reference
    prompt = render_prompt(CONTEXT, "what is the city?")
    prompt_ids = tok(prompt)["input_ids"]
    for model in ("alpha", "beta", "gamma"):
        full = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        expected = tok.decode(_expected(reference, model, prompt_ids), skip_special_tokens=True)
        assert full.choices[0].text == expected, model
        assert full.usage.prompt_tokens == len(prompt_ids)
        assert full.usage.completion_tokens >= 1
        cached = full.usage.prompt_tokens_details.cached_tokens
        assert cached == (0 if model == "gamma" else len(prompt_ids) - 1), model
        streamed = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        assert len([c for c in chunks if c.choices]) >= 2
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat = client.chat.completions.create(model="alpha", messages=[
        {"role": "system", "content": CONTEXT}, {"role": "user", "content": "what is the city?"}],
        max_tokens=MAX_NEW, temperature=0)
    assert chat.choices[0].message.content == tok.decode(
        _expected(reference, "alpha", prompt_ids), skip_special_tokens=True), (chat.usage, chat.model_extra)
    stream = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _agent_runs(url: str) -> float:
    text = _get(url + "/metrics")[1].decode()
    line = next((ln for ln in text.splitlines() if ln.startswith("prefillshare_agent_runs_total ")), None)
    assert line is not None, "prefillshare_agent_runs_total is not on /metrics"
    return float(line.split()[1])


def test_completions_stream_from_the_decoder_while_agent_runs_go_through_the_orchestrator(app, client):
    """A completion never reaches the Orchestrator: the Router runs its shared prefill (the decoder
    loads every prompt token but the last from the base) and streams its decoder itself; an agent
    run's chunks still stream through the Orchestrator."""
    from prefillshare.deployments.metrics import SEND_EVERY_S

    time.sleep(3 * SEND_EVERY_S)  # earlier tests' runs have reached /metrics
    before = _agent_runs(app["url"])
    full = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=4, temperature=0)
    streamed = list(client.chat.completions.create(
        model="beta", messages=[{"role": "system", "content": CONTEXT}, {"role": "user", "content": "the city?"}],
        max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}))
    time.sleep(3 * SEND_EVERY_S)  # what the Orchestrator counted has reached /metrics by now
    after = _agent_runs(app["url"])
    for usage in (full.usage, streamed[-1].usage):
        assert usage.completion_tokens >= 1
        assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # shared prefill loaded
    assert full.model_extra["prefillshare"]["prefill_replica"] is not None
    assert after == before  # no run: the Orchestrator saw neither completion
    status, out = _post(app["url"] + "/v1/agents/run", {"context": CONTEXT, "agents": [
        {"model": "alpha", "instruction": "what is the item?", "max_tokens": 2}]})
    assert status == 200, out
    deadline = time.monotonic() + 10
    while _agent_runs(app["url"]) < after + 1 and time.monotonic() < deadline:
        time.sleep(SEND_EVERY_S)
    assert _agent_runs(app["url"]) == after + 1  # the counter does count a run


def test_fan_out_matches_reference_and_reports_shared_prompt_tokens(app, reference):
    from prefillshare.app.training.tasks import render_prompt

    tok, _ = reference
    agents = [{"name": "a1", "model": "alpha", "instruction": "what is the item?", "max_tokens": MAX_NEW},
              {"name": "b1", "model": "beta", "instruction": "call the shipping tool.", "max_tokens": MAX_NEW},
              {"name": "g1", "model": "gamma", "instruction": "what is the day?", "max_tokens": MAX_NEW},
              {"name": "a2", "model": "alpha", "instruction": "check city=oslo. yes or no?", "max_tokens": MAX_NEW}]
    status, out = _post(app["url"] + "/v1/agents/run", {"context": CONTEXT, "agents": agents})
    assert status == 200, out
    results = {r["name"]: r for r in out["results"]}
    assert set(results) == {"a1", "b1", "g1", "a2"}
    for a in agents:
        r = results[a["name"]]
        prompt_ids = tok(render_prompt(CONTEXT, a["instruction"]))["input_ids"]
        assert r["error"] is None
        assert r["token_ids"] == _expected(reference, a["model"], prompt_ids), (a["name"], r)
        assert r["usage"]["prompt_tokens"] == len(prompt_ids)
        shared = a["model"] != "gamma"
        if shared:  # every prompt token but the last came from the base through the pool
            assert r["usage"]["cached_tokens"] == len(prompt_ids) - 1, a["name"]
        else:  # private prefill: at most whole blocks from the decoder's own prefix cache
            assert r["usage"]["cached_tokens"] % 32 == 0 and r["usage"]["cached_tokens"] < len(prompt_ids) - 1
        assert (r["prefill"] is not None) == shared
    # one prefill call served every sharing agent, on one replica
    assert len({results[n]["prefill"]["replica"] for n in ("a1", "b1", "a2")}) == 1
    ctx_len = len(tok(CONTEXT)["input_ids"])
    assert out["usage"]["shared_prefix_tokens"] >= ctx_len - 1
    assert out["usage"]["cached_tokens"] == sum(r["usage"]["cached_tokens"] for r in results.values())


def test_multi_round_workflow_joins_outputs_and_streams_per_agent(app):
    body = {"context": CONTEXT, "stream": True, "rounds": [
        [{"name": "plan", "model": "alpha", "instruction": "what is the item?", "max_tokens": 4}],
        [{"name": "w1", "model": "alpha", "instruction": "what is the city?", "max_tokens": 4},
         {"name": "w2", "model": "beta", "instruction": "what is the day?", "max_tokens": 4}],
        [{"name": "agg", "model": "beta", "instruction": "call the shipping tool.", "max_tokens": 4}]]}
    req = urllib.request.Request(app["url"] + "/v1/agents/run", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **_auth(KEY_A)})
    events = []
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "done" and kinds.count("round_done") == 3
    assert {e["agent"] for e in events if e["type"] == "delta"} >= {"plan", "w1", "w2", "agg"}
    done = {e["agent"]: e["result"] for e in events if e["type"] == "agent_done"}
    final = events[-1]
    plan_text = done["plan"]["text"].strip()
    assert final["final_context"].startswith(CONTEXT) and f"plan:{plan_text}" in final["final_context"]
    # round 2's prompts contain round 1's output, so they are longer than round 1's
    assert done["w1"]["usage"]["prompt_tokens"] > done["plan"]["usage"]["prompt_tokens"]
    assert all(r["error"] is None for r in done.values())


def test_one_failing_agent_is_reported_while_the_others_complete(app):
    body = {"context": CONTEXT, "rounds": [
        [{"name": "plan", "model": "alpha", "instruction": "call the shipping tool.", "max_tokens": 24}],
        [{"name": "small", "model": "gamma", "instruction": "what is the city?", "max_tokens": 8},
         {"name": "ok", "model": "beta", "instruction": "what is the city?", "max_tokens": 4}]]}
    status, out = _post(app["url"] + "/v1/agents/run", body)
    assert status == 200, out
    res = {(r["round"], r["name"]): r for r in out["results"]}
    assert res[(0, "plan")]["usage"]["completion_tokens"] >= 16  # enough to overflow gamma's 64 tokens
    assert res[(1, "small")]["error"].startswith("context_length_exceeded")
    assert res[(1, "small")]["token_ids"] == []
    assert res[(1, "ok")]["error"] is None and res[(1, "ok")]["usage"]["completion_tokens"] >= 1


def test_different_decoders_over_one_context_use_one_prefill_replica(app, client):
    from prefillshare.app.training.tasks import render_prompt

    contexts = [CONTEXT.replace("maya", n).replace("oslo", c)
                for n, c in (("omar", "rome"), ("lena", "lima"), ("ivan", "kyiv"), ("sara", "doha"))]
    used = set()
    for ctx in contexts:
        replicas = set()
        for model, instruction in (("alpha", "what is the qty?"), ("beta", "what is the color?"),
                                   ("alpha", "call the shipping tool.")):
            status, out = _post(app["url"] + "/v1/completions",
                                {"model": model, "prompt": render_prompt(ctx, instruction), "max_tokens": 2})
            assert status == 200, out
            replicas.add(out["prefillshare"]["prefill_replica"])
        assert len(replicas) == 1, (ctx, replicas)
        used |= replicas
    assert None not in used


def test_metrics_change_with_traffic(app, client):
    before = _metrics(app["url"])
    client.completions.create(model="beta", prompt=CONTEXT + "\nQ: what is the day?\nA:", max_tokens=3)
    client.completions.create(model="gamma", prompt=CONTEXT + "\nQ: what is the day?\nA:", max_tokens=3)
    names = ["prefillshare_ttft_seconds_count", "prefillshare_e2e_seconds_count",
             "prefillshare_generation_tokens_total", "prefillshare_prompt_tokens_total"]
    # (name, labels) that both completions must raise; each replica (Router, Prefill, Decode) sends
    # its own batch fire-and-forget, so wait until every one of them arrived
    grown = [(n, {"model": model}) for n in names for model in ("beta", "gamma")] + [
        ("prefillshare_prefill_tokens_saved_total", {"stage": "decode", "module": "beta"}),
        ("prefillshare_prefill_tokens_computed_total", {"stage": "prefill", "module": "base"}),
        ("prefillshare_fallbacks_total", {"reason": "incompatible"}),
        ("prefillshare_kv_bytes_moved_total", {}),
        # the pool's own counters (pushed every 2 s): beta's connector found the base's blocks
        ("prefillshare_kv_pool_events_total", {"scope": "beta", "event": "hits"})]
    for _ in range(30):
        after = _metrics(app["url"])
        if all(_metric(after, n, **lb) > _metric(before, n, **lb) for n, lb in grown):
            break
        time.sleep(1)
    for n, lb in grown:
        assert _metric(after, n, **lb) > _metric(before, n, **lb), (n, lb)
    assert 0 < _metric(after, "prefillshare_kv_pool_hit_ratio") <= 1
    assert "prefillshare_queue_length" in "".join(after)
    assert _metric(after, "prefillshare_kv_pool_held_bytes") > 0  # blocks are held


# --- the OpenAI surface: sampling options, structured outputs, tools, content parts ----------
PROMPT = CONTEXT + "\nQ: what is the city?\nA:"
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["oslo", "rome", "lima"]},
                                           "qty": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "qty"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}


def test_stop_n_logprobs_and_echo_change_completions_as_openai_documents(app, client):
    greedy = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=12, temperature=0)
    text = greedy.choices[0].text
    assert len(text) >= 4, text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # ends the text before its first occurrence
    cut = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    echo = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=12, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + text
    two = client.completions.create(model="beta", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.completion_tokens >= 2 and all(c.finish_reason for c in two.choices)
    lp = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    assert lp.choices[0].text == text
    got = lp.choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == lp.usage.completion_tokens
    for chosen, top in zip(got.token_logprobs, got.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy: the chosen token is the most likely
    # streamed: two sequences, each with its own finish; logprobs per chunk
    chunks = list(client.completions.create(model="alpha", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
                                            n=2, logprobs=2, stream=True))
    tokens: dict[int, int] = {}
    for c in chunks:
        for ch in c.choices:
            tokens[ch.index] = tokens.get(ch.index, 0) + (len(ch.logprobs.tokens) if ch.logprobs else 0)
    assert set(tokens) == {0, 1} and all(1 <= k <= 6 for k in tokens.values()), tokens
    assert {ch.index for c in chunks for ch in c.choices if ch.finish_reason} == {0, 1}


def test_logit_bias_and_frequency_penalty_change_greedy_output(app, client, reference):
    """A bias that makes one token win every step by >= 1 nat (from its raw log-probabilities),
    then a frequency penalty (2 per earlier occurrence) that must overturn it within 16 steps."""
    tok, _ = reference
    x = tok(" lamp", add_special_tokens=False)["input_ids"][-1]
    forced = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=16, temperature=0,
                                       logit_bias={str(x): 100}, logprobs=2)
    lp = forced.choices[0].logprobs
    assert len(lp.tokens) == 16 and len(set(lp.tokens)) == 1, lp.tokens  # +100: the token wins every step
    xs = lp.tokens[0]
    # raw (unbiased) log-probabilities: how far the best other token leads at each step
    gaps = [max(v for t, v in top.items() if t != xs) - chosen for chosen, top in zip(lp.token_logprobs,
                                                                                       lp.top_logprobs)]
    bias = max(gaps) + 1.0
    assert bias < 100
    plain = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=16, temperature=0,
                                      logit_bias={str(x): bias})
    assert plain.choices[0].text == forced.choices[0].text
    penalized = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=16, temperature=0,
                                          logit_bias={str(x): bias}, frequency_penalty=2.0)
    assert penalized.choices[0].text != plain.choices[0].text
    both = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=16, temperature=0,
                                     logit_bias={str(x): bias}, frequency_penalty=2.0, presence_penalty=2.0)
    assert both.choices[0].text != plain.choices[0].text


def _structured_greedy(reference, model: str, prompt_ids: list[int], schema: dict, private: bool,
                       max_new: int) -> list[int]:
    """Transformers oracle under the same grammar as the engines (xgrammar, compact JSON): greedy
    over the tokens the grammar allows, from the first generated token."""
    import copy

    import xgrammar as xgr

    from prefillshare.app.reference import prompt_kv

    tok, models = reference
    dec = models[model]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=dec.config.vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                            separators=(",", ":"))
    matcher = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    base = dec if private or model == "gamma" else models["base"]
    cache = copy.deepcopy(prompt_kv(base, prompt_ids[:-1]))
    ids = torch.tensor([prompt_ids[-1:]])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = dec(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1:].float()
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device))
            nxt = int(logits[0].argmax())
            out.append(nxt)
            if nxt == tok.eos_token_id or not matcher.accept_token(nxt) or matcher.is_terminated():
                break
            ids = torch.tensor([[nxt]])
    return out


def test_json_schema_holds_for_every_agent_of_a_fan_out_and_matches_the_grammar_oracle(app, client, reference):
    """Every agent (shared KV: alpha, beta; private prefill: gamma) answers JSON valid against the
    schema, token for token what greedy decoding under the same grammar gives in transformers:
    the decoder that loaded the base's KV follows the grammar from its first generated token."""
    import jsonschema

    from prefillshare.app.training.tasks import render_prompt

    tok, _ = reference
    ctx = "order\ncity:oslo\nqty:3"  # short: gamma's context is 64 tokens
    agents = [{"name": m, "model": m, "instruction": "what is the city?", "max_tokens": 40,
               "response_format": RESPONSE_FORMAT} for m in ("alpha", "beta", "gamma")]
    agents[2]["instruction"] = "what is the qty?"
    status, out = _post(app["url"] + "/v1/agents/run", {"context": ctx, "agents": agents})
    assert status == 200, out
    for r, a in zip(out["results"], agents):
        assert r["error"] is None, r
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
        prompt_ids = tok(render_prompt(ctx, a["instruction"]))["input_ids"]
        shared = r["usage"]["cached_tokens"] == len(prompt_ids) - 1
        assert shared == (a["model"] != "gamma"), r
        expected = _structured_greedy(reference, a["model"], prompt_ids, SCHEMA, not shared, 40)
        assert r["token_ids"] == expected, (a["model"], r["text"], tok.decode(expected))
    # the same constraint through both OpenAI routes, whole and streamed, and json_object
    msgs = [{"role": "system", "content": ctx}, {"role": "user", "content": "what is the city?"}]
    chat = client.chat.completions.create(model="alpha", messages=msgs, max_tokens=40, response_format=RESPONSE_FORMAT)
    assert chat.choices[0].message.content == out["results"][0]["text"]  # the same prompt ids as the agent's
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="alpha", messages=msgs, max_tokens=40, response_format=RESPONSE_FORMAT, stream=True) if c.choices)
    assert streamed == chat.choices[0].message.content
    done = client.completions.create(model="beta", prompt=PROMPT, max_tokens=40, extra_body={
        "response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    obj = client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # a complete object (not cut by max_tokens) parses
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_tool_calls_come_back_in_openai_shape_for_a_decoder_that_declares_a_format(app, client):
    import jsonschema

    tools = [{"type": "function", "function": {"name": "ship", "description": "ship an order", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["oslo", "rome"]}, "qty": {"type": "integer",
                                                                                    "minimum": 1, "maximum": 9}},
        "required": ["city", "qty"], "additionalProperties": False}}},
             {"type": "function", "function": {"name": "cancel", "parameters": {
                 "type": "object", "properties": {}, "additionalProperties": False}}}]
    msgs = [{"role": "system", "content": "order\ncity:oslo\nqty:3"}, {"role": "user", "content": "call the shipping tool."}]
    out = client.chat.completions.create(model="alpha", messages=msgs, tools=tools, tool_choice="required",
                                         max_tokens=48)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    named = client.chat.completions.create(model="alpha", messages=msgs, tools=tools, max_tokens=48,
                                           tool_choice={"type": "function", "function": {"name": "ship"}})
    assert named.choices[0].message.tool_calls[0].function.name == "ship"
    streamed = [c for c in client.chat.completions.create(model="alpha", messages=msgs, tools=tools, max_tokens=48,
                                                          tool_choice="required", stream=True) if c.choices]
    calls = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [(call.function.name, call.function.arguments)]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    auto = client.chat.completions.create(model="alpha", messages=msgs, tools=tools, max_tokens=48)
    message = auto.choices[0].message
    assert (message.tool_calls is None) != (message.content is None)  # a call or a text answer, never both
    # the tool's answer goes back as a 'tool' turn
    follow = client.chat.completions.create(model="alpha", max_tokens=4, messages=[
        *msgs, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "shipped"}])
    assert follow.choices[0].message.content is not None


def test_content_parts_and_chat_logprobs(app, client):
    whole = client.chat.completions.create(model="alpha", max_tokens=MAX_NEW, messages=[
        {"role": "system", "content": CONTEXT}, {"role": "user", "content": "what is the city?\nshort answer"}])
    parts = client.chat.completions.create(model="alpha", max_tokens=MAX_NEW, logprobs=True, top_logprobs=2,
                                           messages=[{"role": "system", "content": [{"type": "text", "text": CONTEXT}]},
                                                     {"role": "user", "content": [
                                                         {"type": "text", "text": "what is the city?"},
                                                         {"type": "text", "text": "short answer"}]}])
    assert parts.choices[0].message.content == whole.choices[0].message.content  # parts join with newlines
    content = parts.choices[0].logprobs.content
    assert len(content) == parts.usage.completion_tokens  # one entry per generated token
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    streamed = [c for c in client.chat.completions.create(
        model="alpha", max_tokens=MAX_NEW, logprobs=True, top_logprobs=1, stream=True, stream_options={
            "include_usage": True}, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])]
    entries = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert entries and all(len(t.top_logprobs) == 1 for t in entries)
    assert streamed[-1].usage.completion_tokens == len(entries)


@pytest.mark.parametrize("path, body, status, param", [
    # unknown model / agent, missing and mistyped fields
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": "alpha", "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {**_OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {**_OK, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**_OK, "seed": "x"}, 400, "seed"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/v1/agents/run", {"context": "c", "agents": [{"model": "nope", "instruction": "i"}]}, 404, "agents[0].model"),
    ("/v1/agents/run", {"context": "c", "agents": [_AGENT], "stream": "yes"}, 400, "stream"),
    ("/v1/agents/run", {"context": "c", "agents": [_AGENT], "rounds": "2"}, 400, "rounds"),
    # bodies that are not JSON objects, not UTF-8, too large
    ("/v1/completions", b'{"model": "alpha", "prompt": ', 400, None),
    ("/v1/completions", b'{"model": "alpha", "prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", {"model": "alpha", "prompt": "x" * (MAX_BODY + 10)}, 413, None),
    # empty, oversize, over-context and out-of-vocabulary prompts
    ("/v1/completions", {"model": "alpha", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": "x" * 3000}, 400, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": [5] * 300}, 400, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": [1, 10 ** 6]}, 400, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": [-3, 4]}, 400, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": ["one", "two"]}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "alpha", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "assistant", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/v1/agents/run", {"context": "", "agents": [_AGENT]}, 400, "context"),
    ("/v1/agents/run", {"context": "word " * 400, "agents": [_AGENT]}, 400, "context"),
    # limits: agents, rounds, max_tokens
    ("/v1/agents/run", {"context": "c", "agents": [{**_AGENT, "name": f"a{i}"} for i in range(5)]}, 400, "agents"),
    ("/v1/agents/run", {"context": "c", "agents": [_AGENT], "rounds": 99}, 400, "rounds"),
    ("/v1/agents/run", {"context": "c", "rounds": [[]]}, 400, "rounds[0]"),
    ("/v1/completions", {**_OK, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {**_OK, "max_tokens": 10 ** 12}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/agents/run", {"context": "c", "agents": [{**_AGENT, "max_tokens": 0}]}, 400, "agents[0].max_tokens"),
    # sampling values
    ("/v1/completions", {**_OK, "temperature": 5}, 400, "temperature"),
    ("/v1/completions", b'{"model": "alpha", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {**_OK, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**_OK, "n": MAX_N + 1}, 400, "n"),
    ("/v1/completions", {**_OK, "n": 0}, 400, "n"),
    ("/v1/completions", {**_OK, "stop": 5}, 400, "stop"),
    ("/v1/completions", {**_OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {**_OK, "stop": "s" * 65}, 400, "stop"),
    ("/v1/completions", {**_OK, "logprobs": MAX_LOGPROBS + 1}, 400, "logprobs"),
    ("/v1/completions", {**_OK, "seed": 2 ** 70}, 400, "seed"),
    ("/v1/completions", {**_OK, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {**_OK, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**_OK, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {**_OK, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {**_OK, "suffix": "end"}, 400, "suffix"),
    ("/v1/completions", {**_OK, "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("/v1/completions", {**_OK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, 400, "response_format.json_schema.schema"),
    ("/v1/completions", {**_OK, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": MAX_LOGPROBS + 1}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "beta", "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "ship", "parameters": {"type": "object"}}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                              "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                              "reasoning_effort": "high"}, 400, "reasoning_effort"),
    ("/v1/agents/run", {"context": "c", "agents": [{**_AGENT, "n": MAX_N + 1}]}, 400, "agents[0].n"),
    ("/v1/agents/run", {"context": "c", "agents": [{**_AGENT, "stop": ["a"] * 5}]}, 400, "agents[0].stop"),
    ("/v1/agents/run", {"context": "c", "agents": [{**_AGENT, "response_format": {"type": "json_schema",
     "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer",
                                                                                "minimum": "x"}}}}}}]},
     400, "agents[0].response_format.json_schema.schema"),
    # a body nested deeper than the JSON parser recurses (was a 500)
    ("/v1/agents/run", b"[" * 30000 + b"]" * 30000, 400, None),
    ("/v1/agents/run", {"context": "c", "agents": [{**_AGENT, "temperature": -1}]}, 400, "agents[0].temperature"),
    # unknown fields: rejected on our own schema (OpenAI routes ignore them, tested below)
    ("/v1/agents/run", {"context": "c", "agents": [_AGENT], "temprature": 0}, 400, "temprature"),
    ("/v1/agents/run", {"context": "c", "agents": [{**_AGENT, "bogus": 1}]}, 400, "agents[0].bogus"),
    ("/v1/nowhere", {"model": "alpha"}, 404, None),
])
def test_bad_requests_get_4xx_naming_the_field(app, baseline, path, body, status, param):
    got, out = _post(app["url"] + path, body)
    assert got == status, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    if param:
        assert param.split("[")[0].split(".")[0] in err["message"]


def test_huge_headers_get_4xx_and_the_app_keeps_serving(app):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", app["port"], timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Authorization", f"Bearer {KEY_A}")
        conn.putheader("X-Padding", "p" * 200_000)
        conn.putheader("Content-Type", "application/json")
        body = json.dumps(_OK).encode()
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        status, raw = r.status, r.read()
    except (ConnectionError, http.client.HTTPException):
        status = raw = None  # the HTTP server may close the connection instead of answering
    finally:
        conn.close()
    assert status is None or 400 <= status < 500, status
    if status == 431:  # the app's own limit (limits.max_header_bytes), in the usual error shape
        assert json.loads(raw)["error"]["code"] == "headers_too_large"
    assert _get(app["url"] + "/healthz")[0] == 200


def test_after_the_matrix_engines_serve_and_answers_are_unchanged(app, baseline):
    status, body = _get(app["url"] + "/ready")
    assert status == 200 and json.loads(body)["ready"] is True, body
    for model, text in baseline.items():
        status, out = _post(app["url"] + "/v1/completions", {"model": model, "prompt": CONTEXT + "\nQ: what is the item?\nA:",
                                                             "max_tokens": MAX_NEW, "temperature": 0})
        assert status == 200 and out["choices"][0]["text"] == text, (model, out)
    # OpenAI clients send extras (`user`, `metadata`): accepted and ignored on the OpenAI routes
    status, out = _post(app["url"] + "/v1/completions", {**_OK, "max_tokens": 2, "user": "u-1", "metadata": {"a": 1},
                                                         "presence_penalty": 0, "stop": None})
    assert status == 200, out


def test_app_keeps_serving_after_bad_requests(app, client):
    _post(app["url"] + "/v1/completions", b"\xff\xfe not json")
    _post(app["url"] + "/v1/completions", {"model": "alpha", "prompt": "x" * 3000})
    out = client.completions.create(model="alpha", prompt=CONTEXT + "\nQ: what is the item?\nA:", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    status, body = _get(app["url"] + "/ready")
    assert status == 200 and json.loads(body)["ready"] is True


# --- API keys and tenants ----------------------------------------------------------------
BAD_KEY = "sk-not-a-key-7c1d9e2f4a6b8c0d"


@pytest.mark.parametrize("key", [None, BAD_KEY, KEY_A[:-1]])
def test_generation_routes_need_a_valid_key(app, key):
    for path, body in (("/v1/completions", _OK), ("/v1/chat/completions", {"model": "alpha", "messages": [
            {"role": "user", "content": "hi"}]}), ("/v1/agents/run", {"context": "c", "agents": [_AGENT]})):
        status, out = _post(app["url"] + path, body, key=key)
        assert status == 401, (path, out)
        assert out["error"]["code"] == "invalid_api_key" and out["error"]["param"] is None
        assert (key or "sk-") not in out["error"]["message"]
    # probes and metrics stay open (Kubernetes probes and Prometheus carry no key)
    assert _get(app["url"] + "/ready", key=None)[0] == 200
    assert _get(app["url"] + "/metrics", key=None)[0] == 200


def test_tenants_reuse_only_their_own_cached_prefix(app):
    """Same context, same agents: tenant A's second run hits A's cached prefix; tenant B's
    first run computes everything (its salt gives other KV keys, prefix hashes and routing keys)."""
    names = ["maya", "lamp", "oslo", "teal", "tue", "noon", "rome", "lima", "kyiv", "doha", "pear", "fig"]
    ctx = "tenant probe zq91\n" + "\n".join(f"k{i}:{names[i % 12]}" for i in range(22))
    body = {"context": ctx, "agents": [{"name": "x", "model": "alpha", "instruction": "what is k3?", "max_tokens": 2},
                                       {"name": "y", "model": "alpha", "instruction": "what is k7?", "max_tokens": 2}]}

    def run(key):
        status, out = _post(app["url"] + "/v1/agents/run", body, key=key)
        assert status == 200, out
        for r in out["results"]:  # each tenant's decoders load the KV its own prefill published
            assert r["error"] is None and r["usage"]["cached_tokens"] == r["usage"]["prompt_tokens"] - 1, r
        return out["usage"], {r["prefill"]["replica"] for r in out["results"]}

    a1, a1_replicas = run(KEY_A)
    a2, a2_replicas = run(KEY_A)
    b1, _ = run(KEY_B)
    b2, _ = run(KEY_B)
    assert a1["shared_prefix_tokens"] >= 128  # at least four full blocks of context to reuse
    assert a2_replicas == a1_replicas  # same tenant, same prefix: same prefill replica
    assert a2["prefill_tokens_computed"] <= a1["prefill_tokens_computed"] - 64  # A reused A's prefix
    assert b1["prefill_tokens_computed"] == a1["prefill_tokens_computed"]  # B reused nothing of A's
    assert b2["prefill_tokens_computed"] == a2["prefill_tokens_computed"]  # B reuses its own
    print(f"\nprefill tokens computed: A cold {a1['prefill_tokens_computed']}, A again "
          f"{a2['prefill_tokens_computed']}, B cold {b1['prefill_tokens_computed']}, "
          f"B again {b2['prefill_tokens_computed']}")


def test_keys_never_reach_logs_or_metrics(app):
    _post(app["url"] + "/v1/completions", _OK, key=BAD_KEY)
    _post(app["url"] + "/v1/completions", {**_OK, "max_tokens": 1}, key=KEY_B)
    secrets = [KEY_A, KEY_B, BAD_KEY]
    metrics = _get(app["url"] + "/metrics")[1].decode()
    assert not [k for k in secrets if k in metrics]
    logs = Path(app["ray_tmp"]) / "session_latest" / "logs"
    assert logs.is_dir()
    leaked = []
    for f in logs.rglob("*"):
        if f.is_file():
            text = f.read_bytes()
            leaked += [f"{f.name}: {k[:8]}..." for k in secrets if k.encode() in text]
    assert not leaked


def test_soak_smoke_sends_mixed_traffic_without_errors_and_the_app_accounts_for_each(app, tmp_path):
    """`python -m bench soak` for ~10 s (PREFILLSHARE_SOAK_S to change it) in two windows: a
    well-formed report, no errors, and the Router admitted and completed exactly what was sent.
    The command prints its report (see it with -s)."""
    from bench.__main__ import main

    duration = float(os.environ.get("PREFILLSHARE_SOAK_S", "10"))
    report_file = tmp_path / "soak.json"
    rc = main(["soak", "--url", app["url"], "--duration", str(duration), "--window", str(duration / 2),
               "--concurrency", "2", "--models", "alpha", "--api-key", KEY_A, "--json", str(report_file)])
    rep = json.loads(report_file.read_text())
    assert rc == 0 and rep["errors"] == {} and rep["ok"] == rep["sent"] >= 4, rep
    assert [w["index"] for w in rep["windows"]] == [0, 1]
    assert sum(w["requests"] for w in rep["windows"]) == rep["sent"]
    for kind in ("fanout", "completion"):  # both kinds were sent and timed
        assert any(w["p95_s"][kind] for w in rep["windows"]), kind
        for w in rep["windows"]:
            if w["p95_s"][kind] is not None:
                assert 0 < w["p50_s"][kind] <= w["p95_s"][kind]
    server = rep["server"]
    assert server["admitted"] == server["completed"] == rep["sent"], server
    assert server["failed"] == server["cancelled"] == server["rejected"] == server["inflight_after"] == 0, server
