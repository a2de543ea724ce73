"""The Serve application end to end: real vLLM engines, the real connector, over HTTP.

One app for the whole module (startup is the slow part): a base with TWO prefill replicas,
two decoders that share its KV ("alpha", "beta") and one whose KV shape differs ("gamma",
private prefill). Random weights of the shipped shape, float32 so that tokens compare with
the transformers reference. Run through scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.serve, pytest.mark.engine]

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "checkpoints" / "tokenizer"
CONTEXT = "order\nname:maya\nitem:lamp\nqty:3\ncity:oslo\nday:tue\ncolor:teal\nnote:please call before noon thanks"
MAX_NEW = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_models(root: Path) -> dict[str, Path]:
    """Base + two compatible decoders + one incompatible (3 KV heads), random weights."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from app.models.checkpoint import save_model
    from app.models.identity import prefill_module_id, tokenizer_hash
    from app.models.manifest import DecodeManifest
    from app.models.shapes import llama_config

    # a private copy: the shipped tokenizer may be rebuilt while the test runs
    paths = {"tokenizer": root / "tokenizer"}
    shutil.copytree(TOKENIZER, paths["tokenizer"])
    tok = AutoTokenizer.from_pretrained(str(paths["tokenizer"]))

    def model(seed: int, **over):
        cfg = llama_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        cfg.initializer_range = 0.08  # peaked logits: greedy ties are unlikely
        for k, v in over.items():
            setattr(cfg, k, v)
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)

    paths["base"] = save_model(model(0), root / "base", paths["tokenizer"])
    base_id = prefill_module_id(paths["base"])
    manifest = lambda agent: DecodeManifest(agent, base_id, tokenizer_hash(paths["base"]),  # noqa: E731
                                            {"method": "cache_conditioned"})
    paths["alpha"] = save_model(model(1), root / "alpha", paths["tokenizer"], manifest("alpha"))
    paths["beta"] = save_model(model(2), root / "beta", paths["tokenizer"], manifest("beta"))
    paths["gamma"] = save_model(model(3, num_key_value_heads=3), root / "gamma", paths["tokenizer"], manifest("gamma"))
    return paths


def _app_config(paths: dict[str, Path], pool_dir: str) -> dict:
    engine = {"dtype": "float32", "max_model_len": 256, "kv_cache_gib": 0.125, "block_size": 32,
              "max_num_seqs": 8, "threads_bind": "nobind"}
    dec = lambda name: {"name": name, "model": str(paths[name]), "engine": engine,  # noqa: E731
                        "placement": {"num_cpus": 0.25, "placement_group_bundles": [{"CPU": 0.25}]}}
    return {
        "tokenizer": str(paths["tokenizer"]),
        "pool": {"path": pool_dir, "capacity_gib": 0.125},
        "limits": {"max_tokens_default": MAX_NEW, "max_tokens_cap": 64},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "prefill_modules": [{"name": "base", "model": str(paths["base"]), "engine": engine,
                             "placement": {"num_replicas": 2, "num_cpus": 0.5}}],
        # gamma's shorter context lets a later round overflow it while other agents fit
        "decoders": [dec("alpha"), dec("beta"), {**dec("gamma"), "engine": {**engine, "max_model_len": 64}}],
    }


def _get(url: str, timeout: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    import ray
    from ray import serve

    from app.config import load_config
    from app.serve_app import build

    paths = _make_models(tmp_path_factory.mktemp("models"))
    pool_dir = f"/dev/shm/ps-test-{os.getpid()}"
    cfg = load_config(_app_config(paths, pool_dir))
    tmp = f"/tmp/rs{os.getpid()}"
    os.environ["RAY_TMPDIR"] = tmp
    for attempt in range(3):  # Ray gives its raylet a fixed 30 s to register; a busy 2-core box can miss it
        try:
            ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp)
            break
        except Exception:  # noqa: BLE001
            ray.shutdown()
            if attempt == 2:
                raise
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(cfg), name="ps", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    for _ in range(120):  # every engine answers (not a timing assertion: just waiting for startup)
        status, _ = _get(base + "/ready")
        if status == 200:
            break
        time.sleep(2)
    else:
        pytest.fail(f"/ready never returned 200: {_get(base + '/ready')}")
    yield {"url": base, "paths": paths, "cfg": cfg}
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(pool_dir, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def client(app):
    from openai import OpenAI

    return OpenAI(base_url=app["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(app):
    """Transformers oracle on the same checkpoints (float32 from the bf16 files)."""
    from transformers import AutoTokenizer

    from app.models.checkpoint import load_model

    tok = AutoTokenizer.from_pretrained(str(app["paths"]["tokenizer"]))
    models = {k: load_model(p, torch.float32) for k, p in app["paths"].items() if k != "tokenizer"}
    return tok, models


def _expected(reference, model: str, prompt_ids: list[int]) -> list[int]:
    from app.reference import greedy_from_kv, prompt_kv, shared_greedy

    tok, models = reference
    if model == "gamma":  # private prefill: the decoder computes its whole prompt
        return greedy_from_kv(models["gamma"], prompt_kv(models["gamma"], prompt_ids[:-1]), prompt_ids[-1:],
                              MAX_NEW, tok.eos_token_id)
    return shared_greedy(models["base"], models[model], prompt_ids, MAX_NEW, tok.eos_token_id)


def _metrics(url: str) -> dict[str, float]:
    status, body = _get(url + "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metric(m: dict[str, float], name: str, **labels) -> float:
    total = 0.0
    for key, v in m.items():
        mm = re.match(r"([^{]+)(?:\{(.*)\})?$", key)
        if mm.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', mm.group(2) or ""))
        if all(got.get(k) == v2 for k, v2 in labels.items()):
            total += v
    return total


# --- tests -----------------------------------------------------------------------------
def test_openai_client_lists_models_completes_and_streams_each_decoder(app, client, reference):
    from app.training.tasks import render_prompt

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


def test_fan_out_matches_reference_and_reports_shared_prompt_tokens(app, reference):
    from app.training.tasks import render_prompt

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
                                 headers={"Content-Type": "application/json"})
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
    from app.training.tasks import render_prompt

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
    for _ in range(30):  # metrics are sent fire-and-forget: wait until they arrive
        after = _metrics(app["url"])
        if _metric(after, "prefillshare_e2e_seconds_count", model="gamma") > \
                _metric(before, "prefillshare_e2e_seconds_count", model="gamma"):
            break
        time.sleep(1)
    for n in names:
        for model in ("beta", "gamma"):
            assert _metric(after, n, model=model) > _metric(before, n, model=model), (n, model)
    saved = ("prefillshare_prefill_tokens_saved_total", {"stage": "decode", "module": "beta"})
    assert _metric(after, saved[0], **saved[1]) > _metric(before, saved[0], **saved[1])
    computed = ("prefillshare_prefill_tokens_computed_total", {"stage": "prefill", "module": "base"})
    assert _metric(after, computed[0], **computed[1]) > _metric(before, computed[0], **computed[1])
    assert _metric(after, "prefillshare_fallbacks_total", reason="incompatible") > \
        _metric(before, "prefillshare_fallbacks_total", reason="incompatible")
    assert 0 < _metric(after, "prefillshare_kv_pool_hit_ratio") <= 1
    assert _metric(after, "prefillshare_kv_bytes_moved_total") > _metric(before, "prefillshare_kv_bytes_moved_total")
    assert "prefillshare_queue_length" in "".join(after)
    # the pool's own counters: beta's connector found the base's blocks; blocks are held
    assert _metric(after, "prefillshare_kv_pool_events_total", scope="beta", event="hits") > \
        _metric(before, "prefillshare_kv_pool_events_total", scope="beta", event="hits")
    assert _metric(after, "prefillshare_kv_pool_held_bytes") > 0


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": "alpha", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": "x" * 3000}, 400, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "alpha", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "alpha", "prompt": 5}, 400, "prompt"),
    ("/v1/completions", b'{"model": "alpha", "prompt": ', 400, None),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/chat/completions", {"model": "alpha", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("/v1/agents/run", {"context": "c", "agents": [{"model": "nope", "instruction": "i"}]}, 404, "agents[0].model"),
    ("/v1/agents/run", {"context": "", "agents": [{"model": "alpha", "instruction": "i"}]}, 400, "context"),
    ("/v1/agents/run", {"context": "c", "agents": [{"model": "alpha", "instruction": "i", "max_tokens": 0}]},
     400, "agents[0].max_tokens"),
    ("/v1/agents/run", {"context": "c", "rounds": [[]]}, 400, "rounds[0]"),
    ("/v1/nowhere", {"model": "alpha"}, 404, None),
])
def test_bad_requests_get_4xx_naming_the_field(app, path, body, status, param):
    got, out = _post(app["url"] + path, body)
    assert got == status, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    if param:
        assert param.split("[")[0].split(".")[0] in err["message"]


def test_app_keeps_serving_after_bad_requests(app, client):
    _post(app["url"] + "/v1/completions", b"\xff\xfe not json")
    _post(app["url"] + "/v1/completions", {"model": "alpha", "prompt": "x" * 3000})
    out = client.completions.create(model="alpha", prompt=CONTEXT + "\nQ: what is the item?\nA:", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    status, body = _get(app["url"] + "/ready")
    assert status == 200 and json.loads(body)["ready"] is True
