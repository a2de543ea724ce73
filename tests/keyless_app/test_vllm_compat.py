"""vLLM's own clients against the app: its request extensions (each one's effect, not only
a 200), its extra endpoints, its vllm:* metrics with the shipped Grafana dashboard, and its
benchmark client with its defaults. On the package's app (tests/keyless_test_app.py), mostly its
decoder "lookup" (shares the base's KV, the suite rendering) and "tmpl" (rendered by a chat
template). float32 random weights, so prompt log-probabilities compare with the transformers
reference.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from bench.random_models import post_json as _post

pytestmark = [pytest.mark.serve, pytest.mark.engine]

ROOT = Path(__file__).resolve().parent.parent.parent
DASHBOARD = ROOT / "k8s" / "chart" / "dashboards" / "prefillshare.json"
PROMPT = "order\nname:maya\nitem:lamp\nqty:3\ncity:oslo\nday:tue\ncolor:teal\nsummary"



def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def app(app_url, keyless_models):
    return {"url": app_url, "paths": keyless_models}


@pytest.fixture(scope="module")
def reference(app):
    from transformers import AutoTokenizer

    from prefillshare.app.models.checkpoint import load_model

    tok = AutoTokenizer.from_pretrained(str(app["paths"]["tokenizer"]))
    return tok, {k: load_model(app["paths"][k], torch.float32) for k in ("base", "lookup")}


def _cmpl(app, **body) -> dict:
    status, out = _post(app["url"] + "/v1/completions", {"model": "lookup", "prompt": PROMPT, "temperature": 0,
                                                          "max_tokens": 8, **body})
    assert status == 200, out
    return out


def _ids(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


def _metric_sum(url: str, name: str, **labels) -> float:
    total = 0.0
    for line in _get(url + "/metrics")[1].decode().splitlines():
        m = re.match(r"([^{ ]+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
    return total


def _metric_reaches(url: str, name: str, at_least: float, **labels) -> float:
    """The metric once it reaches ``at_least`` (metrics are fire-and-forget events: they land a
    moment after the answer), or its value after 30 s."""
    for _ in range(30):
        value = _metric_sum(url, name, **labels)
        if value >= at_least:
            return value
        time.sleep(1)
    return value


# --- sampling extensions ------------------------------------------------------------------
def test_return_token_ids_are_the_tokenized_prompt_and_the_generated_text(app, reference):
    out = _cmpl(app, return_token_ids=True, ignore_eos=True)
    c = out["choices"][0]
    status, tok = _post(app["url"] + "/tokenize", {"model": "lookup", "prompt": PROMPT})
    assert status == 200 and c["prompt_token_ids"] == tok["tokens"] and tok["count"] == out["usage"]["prompt_tokens"]
    assert len(c["token_ids"]) == out["usage"]["completion_tokens"] == 8
    shown = [t for t in c["token_ids"] if t not in reference[0].all_special_ids]  # the text skips special tokens
    status, text = _post(app["url"] + "/detokenize", {"model": "lookup", "tokens": shown})
    assert status == 200 and text["prompt"] == c["text"]


def test_ignore_eos_min_tokens_and_stop_token_ids_set_the_length(app, reference):
    eos = reference[0].eos_token_id
    forced = {"logit_bias": {str(eos): 100}, "return_token_ids": True}
    assert _ids(_cmpl(app, **forced)) == [eos]  # eos first: the answer ends there
    out = _cmpl(app, **forced, ignore_eos=True, max_tokens=5)
    assert (_ids(out), out["choices"][0]["finish_reason"]) == ([eos] * 5, "length")
    assert len(_ids(_cmpl(app, **forced, min_tokens=4))) >= 4  # eos is masked until 4 tokens
    free = _ids(_cmpl(app, ignore_eos=True, return_token_ids=True))
    stop_at = free[2]
    out = _cmpl(app, ignore_eos=True, return_token_ids=True, stop_token_ids=[stop_at])
    assert _ids(out) == free[:free.index(stop_at) + 1] and out["choices"][0]["finish_reason"] == "stop"


def test_allowed_token_ids_and_bad_words_restrict_the_tokens(app, reference):
    tok = reference[0]
    free = _ids(_cmpl(app, ignore_eos=True, return_token_ids=True))
    allowed = [free[0] + 1, free[0] + 2] if free[0] + 2 < len(tok) else [3, 4]
    assert set(_ids(_cmpl(app, allowed_token_ids=allowed, return_token_ids=True))) <= set(allowed)
    longer = _ids(_cmpl(app, ignore_eos=True, return_token_ids=True, max_tokens=48))
    word = next(t for t in longer if tok.decode([t]).strip().isalpha())
    banned = _ids(_cmpl(app, ignore_eos=True, return_token_ids=True, bad_words=[tok.decode([word]).strip()]))
    assert word not in banned
    assert _ids(_cmpl(app, ignore_eos=True, return_token_ids=True, max_tokens=48,
                      bad_words=[tok.decode([word]).strip()])) != longer


def test_include_stop_str_and_special_token_switches_change_the_text(app, reference):
    free = _cmpl(app, ignore_eos=True)["choices"][0]["text"]
    stop = free[3:5]
    assert _cmpl(app, ignore_eos=True, stop=[stop])["choices"][0]["text"] == free[:free.index(stop)]
    assert _cmpl(app, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"] == \
        free[:free.index(stop) + len(stop)]
    eos = reference[0].eos_token_id
    eos_text = reference[0].convert_ids_to_tokens(eos)
    forced = {"logit_bias": {str(eos): 100}, "ignore_eos": True, "max_tokens": 3}
    assert _cmpl(app, **forced)["choices"][0]["text"] == ""
    assert _cmpl(app, **forced, skip_special_tokens=False)["choices"][0]["text"] == eos_text * 3
    # this fast tokenizer's decoder puts no space between special tokens: the switch is accepted and
    # changes nothing, as on vLLM's server with the same tokenizer
    assert _cmpl(app, **forced, skip_special_tokens=False, spaces_between_special_tokens=False)[
        "choices"][0]["text"] == eos_text * 3


def test_structured_outputs_hold_on_both_routes_and_per_agent(app):
    choice = _cmpl(app, structured_outputs={"choice": ["north", "south"]})["choices"][0]["text"]
    assert choice in ("north", "south")
    regex = _cmpl(app, structured_outputs={"regex": "[a-c]{4}"})["choices"][0]["text"]
    assert re.fullmatch("[a-c]{4}", regex)
    grammar = _cmpl(app, structured_outputs={"grammar": 'root ::= "yes" | "no"'})["choices"][0]["text"]
    assert grammar in ("yes", "no")
    status, chat = _post(app["url"] + "/v1/chat/completions", {
        "model": "lookup", "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "temperature": 0,
        "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                        "required": ["a"], "additionalProperties": False}}})
    assert status == 200 and isinstance(json.loads(chat["choices"][0]["message"]["content"])["a"], bool)
    status, run = _post(app["url"] + "/v1/agents/run", {"context": PROMPT, "agents": [
        {"name": "a", "model": "lookup", "instruction": "dir", "structured_outputs": {"choice": ["up", "down"]}},
        {"name": "b", "model": "lookup", "instruction": "n", "ignore_eos": True, "min_tokens": 6, "max_tokens": 6}]})
    assert status == 200, run
    by = {r["name"]: r for r in run["results"]}
    assert by["a"]["text"] in ("up", "down") and len(by["b"]["token_ids"]) == 6


def test_echo_with_logprobs_scores_the_prompt_with_the_decoder_privately(app, reference):
    tok, models = reference
    before = _metric_sum(app["url"], "prefillshare_fallbacks_total", reason="prompt_logprobs")
    out = _cmpl(app, echo=True, logprobs=1, max_tokens=1)
    c = out["choices"][0]
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = models["lookup"](torch.tensor([ids])).logits[0].log_softmax(-1)
    want = [None] + [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    got = c["logprobs"]["token_logprobs"][:len(ids)]
    assert got[0] is None and c["text"].startswith(PROMPT)
    assert max(abs(g - w) for g, w in zip(got[1:], want[1:])) < 1e-3
    assert len(c["logprobs"]["tokens"]) == len(ids) + 1
    plp = _cmpl(app, prompt_logprobs=2, max_tokens=1)["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and abs(plp[1][str(ids[1])]["logprob"] - want[1]) < 1e-3
    assert sum(e["rank"] == 1 for e in plp[1].values()) == 1
    assert _metric_reaches(app["url"], "prefillshare_fallbacks_total", before + 2, reason="prompt_logprobs") \
        >= before + 2


def test_return_tokens_as_token_ids_names_each_token_by_id(app):
    out = _cmpl(app, logprobs=1, return_tokens_as_token_ids=True, return_token_ids=True)
    c = out["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]


def test_truncate_prompt_tokens_cuts_the_prompt_before_the_shared_prefill(app):
    full = _cmpl(app, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    out = _cmpl(app, truncate_prompt_tokens=10, return_token_ids=True)
    assert out["choices"][0]["prompt_token_ids"] == full[-10:] and out["usage"]["prompt_tokens"] == 10
    same = _cmpl(app, prompt=full[-10:], return_token_ids=True)
    assert _ids(out) == _ids(same) and out["prefillshare"]["prefill_module"] == "base"


def _saved_per_salt(app, send, salts: tuple[str, str]) -> list[float]:
    """The base's prefix-cache savings after each of three requests salted a, b, a (salts not
    used by another test: a salt's cache is shared by every prompt that starts alike)."""
    saved = lambda: _metric_sum(app["url"], "prefillshare_prefill_tokens_saved_total", stage="prefill")  # noqa: E731
    # one prefill record per request carries its saved tokens and its call time: counting the
    # records says this request's has landed (the decoder's request record comes in another batch,
    # from another replica, and may land first)
    done = _metric_sum(app["url"], "prefillshare_prefill_seconds_count")
    after = []
    for salt in (*salts, salts[0]):
        send(salt)
        done = _metric_reaches(app["url"], "prefillshare_prefill_seconds_count", done + 1)
        after.append(saved())
    return after


def test_cache_salt_separates_the_prefix_cache(app):
    after = _saved_per_salt(app, lambda salt: _cmpl(app, prompt=PROMPT + " salted", cache_salt=salt), ("s1", "s2"))
    assert after[1] == after[0]  # another salt: nothing of the prompt was cached for it
    assert after[2] >= after[1] + 32  # the same salt again: the base's prefix cache served a block or more


def test_an_agent_runs_cache_salt_separates_its_shared_context(app):
    """One salt per run (its agents share one context): same effect as on a completion."""
    def run(salt: str | None) -> tuple[int, dict]:
        return _post(app["url"] + "/v1/agents/run", {"context": PROMPT + " salted run", "cache_salt": salt,
                                                     "agents": [{"model": "lookup", "instruction": "go", "max_tokens": 2}]})

    def send(salt: str) -> None:
        status, out = run(salt)
        assert status == 200 and out["results"][0]["error"] is None, out

    after = _saved_per_salt(app, send, ("r1", "r2"))
    assert after[1] == after[0] and after[2] >= after[1] + 32
    status, out = run("")
    assert status == 400 and out["error"]["param"] == "cache_salt", out


def test_priority_other_than_zero_is_refused_as_vllm_does_without_priority_scheduling(app):
    assert _cmpl(app, priority=0)["choices"]
    status, out = _post(app["url"] + "/v1/completions", {"model": "lookup", "prompt": PROMPT, "priority": 2})
    assert status == 400 and out["error"]["param"] == "priority"


# --- chat-template switches -----------------------------------------------------------------
def _tokenize_chat(app, messages, **kw) -> list[int]:
    status, out = _post(app["url"] + "/tokenize", {"model": "tmpl", "messages": messages, **kw})
    assert status == 200, out
    return out["tokens"]


def test_chat_template_switches_change_the_prompt_the_decoder_sees(app, reference):
    tok = reference[0]
    msgs = [{"role": "user", "content": "hello"}]
    with_prompt = _tokenize_chat(app, msgs)
    assert tok.decode(with_prompt).endswith("<assistant>")
    assert tok.decode(_tokenize_chat(app, msgs, add_generation_prompt=False)).endswith("</user>")
    assert tok.decode(_tokenize_chat(app, msgs, chat_template_kwargs={"shout": True})).endswith("<assistant>!")
    cont = [*msgs, {"role": "assistant", "content": "hel"}]
    assert tok.decode(_tokenize_chat(app, cont, add_generation_prompt=False, continue_final_message=True)).endswith(
        "<assistant>hel")
    status, out = _post(app["url"] + "/v1/chat/completions", {
        "model": "tmpl", "messages": msgs, "add_generation_prompt": False, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True})
    assert status == 200 and out["prompt_token_ids"] == _tokenize_chat(app, msgs, add_generation_prompt=False)
    status, out = _post(app["url"] + "/v1/chat/completions", {
        "model": "tmpl", "messages": cont, "add_generation_prompt": False, "continue_final_message": True,
        "echo": True, "max_tokens": 4, "temperature": 0})
    assert status == 200 and out["choices"][0]["message"]["content"].startswith("hel")
    status, out = _post(app["url"] + "/v1/chat/completions", {"model": "tmpl", "messages": msgs,
                                                              "chat_template": "{{ 'x' }}"})
    assert status == 400 and out["error"]["param"] == "chat_template"
    # a switch the decoder's rendering would ignore is refused, naming it, for every kind of decoder:
    # tmpl's template reads no 'think'; lookup (a full decoder), ad0 (a decode group's adapter) and ie0
    # (in-engine) render in the suite format, which has no template and no generation prompt
    for model, body, param in [("tmpl", {"chat_template_kwargs": {"think": False}}, "chat_template_kwargs.think"),
                               *((m, {"add_generation_prompt": False}, "add_generation_prompt")
                                 for m in ("lookup", "ad0", "ie0")),
                               ("ie0", {"chat_template_kwargs": {"shout": True}}, "chat_template_kwargs.shout")]:
        status, out = _post(app["url"] + "/v1/chat/completions", {"model": model, "messages": msgs, **body})
        assert status == 400 and out["error"]["param"] == param, (model, out)


# --- vLLM's extra endpoints --------------------------------------------------------------------
def test_version_health_and_tokenize_shapes(app):
    from vllm.version import __version__

    status, body = _get(app["url"] + "/version")
    assert status == 200 and json.loads(body) == {"version": __version__}
    assert _get(app["url"] + "/health") == (200, b"")
    status, out = _post(app["url"] + "/tokenize", {"model": "lookup", "prompt": "hi there", "return_token_strs": True,
                                                   "add_special_tokens": False})
    assert status == 200 and set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["max_model_len"] == 256 and len(out["token_strs"]) == out["count"] == len(out["tokens"])
    status, out = _post(app["url"] + "/tokenize", {"model": "nope", "prompt": "hi"})
    assert status == 404 and out["error"]["param"] == "model"
    status, out = _post(app["url"] + "/detokenize", {"model": "lookup", "tokens": [10 ** 7]})
    assert status == 400 and out["error"]["param"] == "tokens"


# --- vLLM's metrics and the dashboard ----------------------------------------------------------
def dashboard_metrics() -> set[str]:
    """Every metric name a panel of the shipped dashboard queries."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dash["templating"]["list"] if v.get("type") == "query"]
    return {m for e in exprs for m in re.findall(r"(?:vllm:|prefillshare_)[a-zA-Z0-9_:]+", e)}


def test_engines_vllm_metrics_are_exported_per_replica_and_feed_every_dashboard_panel(app):
    _cmpl(app, max_tokens=4)  # shared: KV loaded from the pool
    _cmpl(app, max_tokens=1, echo=True, logprobs=0)  # private: a fallback
    _post(app["url"] + "/v1/chat/completions", {"model": "tmpl", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2})
    want = dashboard_metrics()
    names: set[str] = set()
    text = ""
    for _ in range(30):  # engines push their samples every ENGINE_PUSH_S; waiting for them, not timing
        text = _get(app["url"] + "/metrics")[1].decode()
        names = {re.match(r"[^{ ]+", ln).group(0) for ln in text.splitlines() if ln and not ln.startswith("#")}
        if want <= names:
            break
        time.sleep(1)
    missing = want - names
    assert not missing, f"panels query metrics the app does not export: {sorted(missing)}"
    ttft = [ln for ln in text.splitlines() if ln.startswith("vllm:time_to_first_token_seconds_count{")]
    labels = [dict(re.findall(r'(\w+)="([^"]*)"', ln)) for ln in ttft]
    assert {lab["model_name"] for lab in labels} >= {"lookup", "tmpl", "base"}
    assert all(lab["deployment"] and lab["replica"] for lab in labels)
    assert _metric_sum(app["url"], "vllm:prompt_tokens_total", model_name="lookup") > 0


def test_every_dashboard_panel_shows_data_from_a_real_run(app, tmp_path):
    """Traffic for a while, /metrics scraped meanwhile, each panel's queries evaluated on the scrapes
    (bench/plot_dashboard.py). PREFILLSHARE_DASHBOARD_PNG=docs/img/dashboard.png keeps the picture."""
    import importlib.util
    import threading

    spec = importlib.util.spec_from_file_location("plot_dashboard", ROOT / "bench" / "plot_dashboard.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    stop = threading.Event()

    def traffic():
        i = 0
        while not stop.is_set():
            i += 1
            _post(app["url"] + "/v1/agents/run", {"context": f"{PROMPT}\nrun:{i}", "agents": [
                {"name": "a", "model": "lookup", "instruction": "city?", "max_tokens": 6, "ignore_eos": True},
                {"name": "t", "model": "tmpl", "instruction": "day?", "max_tokens": 6, "ignore_eos": True}]})
            _post(app["url"] + "/v1/completions", {"model": "lookup", "prompt": f"{PROMPT} {i}", "max_tokens": 4,
                                                   "echo": i % 3 == 0, "logprobs": 1 if i % 3 == 0 else None})

    workers = [threading.Thread(target=traffic) for _ in range(2)]
    for w in workers:
        w.start()
    scrapes = []
    try:
        for _ in range(12):  # 24 s: every panel's window of 3 scrapes sees traffic 9 times
            scrapes.append(plot.scrape(app["url"]))
            time.sleep(2)
    finally:
        stop.set()
        for w in workers:
            w.join()
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        series = [plot.evaluate(t["expr"], scrapes[i - 3], scrapes[i]) for t in p["targets"]
                  for i in range(3, len(scrapes))]
        assert any(series), f"panel {p['title']!r} has no data"
    out = os.environ.get("PREFILLSHARE_DASHBOARD_PNG") or str(tmp_path / "dashboard.png")
    plot.plot(scrapes, out)
    assert Path(out).stat().st_size > 10_000


# --- vLLM's benchmark client ---------------------------------------------------------------
def test_vllm_bench_serve_with_its_defaults_completes_every_request(app, tmp_path):
    """`vllm bench serve` as a user runs it: this venv's `vllm` command (the dist alias that
    scripts/setup.sh writes lets it start), random dataset, which sends ignore_eos."""
    n = 8
    vllm = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm), "bench", "serve", "--backend", "openai", "--base-url",
           app["url"], "--model", "lookup", "--tokenizer", str(app["paths"]["tokenizer"]), "--dataset-name", "random",
           "--random-input-len", "32", "--random-output-len", "4", "--num-prompts", str(n), "--save-result",
           "--result-dir", str(tmp_path), "--result-filename", "bench.json", "--disable-tqdm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result["total_output_tokens"]) == (n, 4 * n), done.stdout[-2000:]
