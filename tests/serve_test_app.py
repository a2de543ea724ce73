"""The Serve test app: real vLLM engines, the real connector, over HTTP, on a private Ray cluster.

A base with TWO prefill replicas, two decoders that share its KV ("alpha", "beta") and one whose
KV shape differs ("gamma", private prefill). Random weights of the shipped shape, float32 so that
tokens compare with the transformers reference. The app runs with API keys on (two tenants), a
small ingress admission limit and a tiny queue on "beta"; every request carries tenant A's key
unless it says otherwise.

The fixtures are registered in tests/shared_app/conftest.py: one app (``shared_app``) for that
package's modules, the functional tests (test_serve_app.py) and the faults (test_serve_faults.py);
``app``, ``client`` and ``baseline`` are per module, ``app`` waiting until every engine answers.
An app start costs minutes on 2 cores; sharing it keeps CI's time down. Run through scripts/test.sh
(loopback-only network namespace).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hang_report import bounded

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = "order\nname:maya\nitem:lamp\nqty:3\ncity:oslo\nday:tue\ncolor:teal\nnote:please call before noon thanks"
MAX_NEW = 8
KEY_A = "sk-test-acme-4f0c2a9b7e51d3c8"  # tenant "acme"
KEY_B = "sk-test-globex-9d2e7a1c5b34f60e"  # tenant "globex"
MAX_INFLIGHT = 4  # ingress admission limit of the test app
MAX_BODY = 65536
MAX_N = 4  # limits.max_n of the test app
MAX_LOGPROBS = 5  # limits.max_logprobs
# limits.max_tokens_cap: the fault tests' streams ask for this many tokens ignoring EOS, so that a
# hang-up or a kill lands while tokens still flow (alpha's context is 256 tokens)
LONG_NEW = 240


def _make_models(root: Path) -> dict[str, Path]:
    """Base + two compatible decoders + one incompatible (3 KV heads). alpha's manifest declares
    the "json" tool-call format (deployments/ingress/tools.py); beta and gamma declare none."""
    from dataclasses import replace

    from bench.random_models import make_models
    from prefillshare.app.models.manifest import read_manifest, write_manifest

    paths = make_models(root, {"alpha": (1, {}), "beta": (2, {}), "gamma": (3, {"num_key_value_heads": 3})})
    write_manifest(paths["alpha"], replace(read_manifest(paths["alpha"]), tool_call_format="json"))
    return paths


# the engine settings of every test app's engine: float32 (tokens compare with the reference), small
TEST_ENGINE = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": "128MiB", "block_size": 32,
               "max_num_seqs": 8, "threads_bind": "nobind"}


def decoder_entry(paths: dict[str, Path], name: str) -> dict:
    """A test app's decoders entry: one replica in its own small bundle."""
    return {"name": name, "model": str(paths[name]), "engine": TEST_ENGINE,
            "placement": {"num_cpus": 0.25, "placement_group_bundles": [{"CPU": 0.25}]}}


def _app_config(paths: dict[str, Path], pool_dir: str, keys_file: Path) -> dict:
    engine = TEST_ENGINE
    dec = lambda name: decoder_entry(paths, name)  # noqa: E731
    return {
        "tokenizer": str(paths["tokenizer"]),
        "pool": {"path": pool_dir, "capacity_bytes": "128MiB"},
        "limits": {"max_tokens_default": MAX_NEW, "max_tokens_cap": LONG_NEW, "max_agents": 4,
                   "max_n": MAX_N,
                   "max_logprobs": MAX_LOGPROBS,
                   "max_inflight_requests": MAX_INFLIGHT, "max_body_bytes": MAX_BODY, "retry_after_s": 2},
        "auth": {"keys_file": str(keys_file)},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "prefill_modules": [{"name": "base", "model": str(paths["base"]), "engine": engine,
                             "placement": {"num_replicas": 2, "num_cpus": 0.5}}],
        # gamma's shorter context lets a later round overflow it while other agents fit
        # beta runs one request at a time and queues one more: Serve sheds the rest (429)
        "decoders": [dec("alpha"),
                     {**dec("beta"), "placement": {**dec("beta")["placement"], "max_ongoing_requests": 1,
                                                   "max_queued_requests": 1}},
                     {**dec("gamma"), "engine": {**engine, "max_model_len": 64}}],
    }


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _get(url: str, timeout: float = 30, key: str | None = KEY_A) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_auth(key)), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: bytes | dict, timeout: float = 120, key: str | None = KEY_A,
          with_headers: bool = False):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **_auth(key)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, headers = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), e.headers
    out = json.loads(raw)
    return (status, out, headers) if with_headers else (status, out)


@pytest.fixture(scope="package")
def shared_app(tmp_path_factory):
    """The app, started once for the package that imports this fixture (tests/shared_app)."""
    from bench.random_models import serve_app
    from prefillshare.app.config import load_config

    paths = _make_models(tmp_path_factory.mktemp("models"))
    pool_dir = f"/dev/shm/ps-test-{os.getpid()}"
    keys_file = tmp_path_factory.mktemp("auth") / "keys.yaml"
    keys_file.write_text(f"{KEY_A}: acme\n{KEY_B}: globex\n")
    cfg = load_config(_app_config(paths, pool_dir, keys_file))
    tmp = f"/tmp/rs{os.getpid()}"
    # a private Ray cluster, started with retries (a busy 2-core box can miss the raylet's 30 s)
    with serve_app(cfg, "ps", tmp, pool_dir) as base:
        yield {"url": base, "paths": paths, "cfg": cfg, "ray_tmp": tmp, "port": int(base.rsplit(":", 1)[1])}
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def app(shared_app):
    """The shared app as each module finds it: every engine answering /ready first, so that no
    module depends on what another one's fault tests did to it."""
    from bench.random_models import wait_app_ready

    wait_app_ready(shared_app["url"])
    return shared_app


@pytest.fixture(scope="module")
def client(app):
    from openai import OpenAI

    return OpenAI(base_url=app["url"] + "/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def reference(shared_app):
    """Transformers oracle on the same checkpoints (float32 from the bf16 files)."""
    import torch
    from transformers import AutoTokenizer

    from prefillshare.app.models.checkpoint import load_model

    tok = AutoTokenizer.from_pretrained(str(shared_app["paths"]["tokenizer"]))
    models = {k: load_model(p, torch.float32) for k, p in shared_app["paths"].items() if k != "tokenizer"}
    return tok, models


def _expected(reference, model: str, prompt_ids: list[int], private: bool = False) -> list[int]:
    from prefillshare.app.reference import greedy_from_kv, prompt_kv, shared_greedy

    tok, models = reference
    if private or model == "gamma":  # private prefill: the decoder computes its whole prompt
        return greedy_from_kv(models[model], prompt_kv(models[model], prompt_ids[:-1]), prompt_ids[-1:],
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



_AGENT = {"model": "alpha", "instruction": "what is the city?"}
_OK = {"model": "alpha", "prompt": "hi"}


@pytest.fixture(scope="module")
def baseline(app):
    """Greedy answers of every decoder before the bad-input matrix runs (compared after it)."""
    return {m: _post(app["url"] + "/v1/completions", {"model": m, "prompt": CONTEXT + "\nQ: what is the item?\nA:",
                                                     "max_tokens": MAX_NEW, "temperature": 0})[1]["choices"][0]["text"]
            for m in ("alpha", "beta", "gamma")}



def _ingress_state(app) -> dict:
    status, body = _get(app["url"] + "/ready")
    assert status == 200, body
    return json.loads(body)["admission"]


def prefill_call(app_name: str, module: str, request, timeout_s: float = 120):
    """A Prefill replica's ticket for ``request``, called from the test process and bounded
    as a whole (handle lookup, router start, result: tests/hang_report.bounded). A call stuck for
    ``timeout_s`` fails the test with the frame it was stuck in (``Stuck``), instead of holding it
    until pytest-timeout: a hang is a defect to see, not to retry past."""
    from ray import serve

    name = f"Prefill-{module}"
    # serve.get_deployment_handle gives this process's cached handle (its router included)
    return bounded(lambda: serve.get_deployment_handle(name, app_name).prefill.remote(request).result(),
                   timeout_s, f"{name}.prefill")


def nixl_events(url: str, module: str, event: str) -> float:
    """Hand-over "vllm-nixl": a decoder's (``module``) count of ``event`` on /metrics."""
    return _metric(_metrics(url), "prefillshare_vllm_nixl_events_total", module=module, event=event)


def wait_for_nixl_event(url: str, module: str, event: str, at_least: float) -> float:
    """The metrics events travel fire-and-forget: wait (bounded) until the count arrived."""
    for _ in range(60):
        n = nixl_events(url, module, event)
        if n >= at_least:
            return n
        time.sleep(1)
    return nixl_events(url, module, event)
