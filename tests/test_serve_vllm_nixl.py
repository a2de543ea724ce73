"""The Serve application on hand-over "vllm-nixl": vLLM's NixlConnector between the base and two
decoders with other weights plus a LoRA decode group, real engines, over HTTP, across Ray nodes.

The three-raylet cluster of tests/ray_cluster.py (head, prefill node, decode node): the prefill
module's bundle asks for ``prefill_node``, every decoder's for ``decode_node``, as the KubeRay
worker groups place them. There is no pool and no block server in this mode: each engine listens
for NIXL handshakes on its own port, and a decoder pulls the blocks its lease names from the
prefill engine on the other raylet.

Random weights of the shipped shape (tests/random_models.py), float32 so that tokens compare with
the transformers reference. Completions and a 2-agent fan-out must give ``app.reference``'s
shared-KV greedy tokens with every prompt token but the last pulled from the base (one lease per
decoder); a lease that ran out before the decoder took its request must be answered with the
private reference's tokens and counted on /metrics. API keys are on, so every prefill carries the
tenant's cache salt. Run through scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
from ray_cluster import replica_nodes, serving_cluster
from serve_test_app import (
    KEY_A,
    MAX_NEW,
    TEST_ENGINE,
    _expected,
    _metric,
    _metrics,
    _post,
    decoder_entry,
    nixl_events,
    wait_for_nixl_event,
)

pytest.importorskip("nixl._api")

pytestmark = [pytest.mark.serve, pytest.mark.engine]

CONTEXT = "order\nname:maya\nitem:lamp\nqty:3\ncity:oslo\nday:tue\ncolor:teal\nnote:please call before noon thanks"
APP = "psn"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"  # vLLM's counter (nixl/stats.py), as its replica pushes it


def _on(node: str, entry: dict) -> dict:
    """A deployment entry placed on the raylet advertising ``node``, as a KubeRay worker group's pods."""
    return {**entry, "placement": {"num_cpus": 0, "placement_group_bundles": [{node: 0.1}]}}


def _app_config(paths, pool_dir: str, keys_file) -> dict:
    return {
        "tokenizer": str(paths["tokenizer"]),
        "handover": "vllm-nixl",
        "pool": {"path": pool_dir, "capacity_bytes": "64MiB"},
        # the lease follows the request timeout (35 s): short enough for the expiry test to wait it out
        "limits": {"max_tokens_default": MAX_NEW, "max_tokens_cap": 64, "max_agents": 4, "request_timeout_s": 30},
        "auth": {"keys_file": str(keys_file)},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "prefill_modules": [_on("prefill_node", {"name": "base", "model": str(paths["base"]), "engine": TEST_ENGINE})],
        "decoders": [_on("decode_node", decoder_entry(paths, "alpha")), _on("decode_node", decoder_entry(paths, "beta")),
                     _on("decode_node", {**decoder_entry(paths, "base"), "name": "group", "max_lora_rank": 8,
                                         "adapters": [{"name": "ad0", "path": str(paths["ad0"]), "rank": 8}]})],
    }


@pytest.fixture(scope="module")
def nixl_app(tmp_path_factory):
    from random_models import make_models

    from app.bench.models import random_adapter
    from app.config import load_config
    from deployments.application import build

    root = tmp_path_factory.mktemp("models")
    paths = make_models(root, {"alpha": (1, {}), "beta": (2, {})})
    # B ~ N(0, 0.1): the adapter changes the base's greedy tokens
    paths["ad0"] = random_adapter(root / "ad0", paths["base"], "ad0", 8, seed=1, b_std=0.1)
    pool_dir = f"/dev/shm/ps-nixl-test-{os.getpid()}"
    keys_file = tmp_path_factory.mktemp("auth") / "keys.yaml"
    keys_file.write_text(f"{KEY_A}: acme\n")
    cfg = load_config(_app_config(paths, pool_dir, keys_file))
    with serving_cluster("sn", (pool_dir,)) as sc:
        url = sc.serve({APP: (build(cfg), "/")})
        yield {"url": url, "paths": paths, "nodes": sc.nodes}


@pytest.fixture(scope="module")
def nixl_reference(nixl_app):
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from app.models.checkpoint import load_model

    paths = nixl_app["paths"]
    tok = AutoTokenizer.from_pretrained(str(paths["tokenizer"]))
    models = {k: load_model(paths[k], torch.float32) for k in ("base", "alpha", "beta")}
    # the group's adapter on the base's KV: the merged decoder (tests/keyless_app/test_lora_groups.py)
    models["ad0"] = PeftModel.from_pretrained(load_model(paths["base"], torch.float32),
                                              str(paths["ad0"])).merge_and_unload().eval()
    return tok, models


def test_prefill_and_decoders_run_on_their_nodes(nixl_app):
    nodes = replica_nodes()
    assert nodes["Prefill-base"] == {nixl_app["nodes"]["prefill"]}, nodes
    for d in ("Decode-alpha", "Decode-beta", "Decode-group"):
        assert nodes[d] == {nixl_app["nodes"]["decode"]}, (d, nodes)


def test_completions_pull_the_bases_kv_and_match_the_shared_reference(nixl_app, nixl_reference):
    from app.training.tasks import render_prompt

    tok, _ = nixl_reference
    prompt = render_prompt(CONTEXT, "what is the city?")
    prompt_ids = tok(prompt)["input_ids"]
    url = nixl_app["url"]
    for model in ("alpha", "beta", "ad0"):
        status, out = _post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_NEW,
                                                     "temperature": 0})
        assert status == 200, out
        assert out["choices"][0]["text"] == tok.decode(_expected(nixl_reference, model, prompt_ids),
                                                       skip_special_tokens=True), model
        usage = out["usage"]
        assert usage["prompt_tokens"] == len(prompt_ids)
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, model  # the pull
    assert wait_for_nixl_event(url, "alpha", "pull", 1) >= 1
    assert wait_for_nixl_event(url, "beta", "pull", 1) >= 1
    assert wait_for_nixl_event(url, "group", "pull", 1) >= 1  # the group's replica counts under its deployment


def test_fan_out_takes_one_lease_per_decoder_and_matches_the_shared_reference(nixl_app, nixl_reference):
    from app.training.tasks import render_prompt

    tok, _ = nixl_reference
    url = nixl_app["url"]
    pulls = {m: nixl_events(url, m, "pull") for m in ("alpha", "beta")}
    agents = [{"name": "a", "model": "alpha", "instruction": "what is the item?", "max_tokens": MAX_NEW},
              {"name": "b", "model": "beta", "instruction": "what is the day?", "max_tokens": MAX_NEW}]
    status, out = _post(url + "/v1/agents/run", {"context": CONTEXT, "agents": agents})
    assert status == 200, out
    results = {r["name"]: r for r in out["results"]}
    for a in agents:
        r = results[a["name"]]
        prompt_ids = tok(render_prompt(CONTEXT, a["instruction"]))["input_ids"]
        assert r["error"] is None, r
        assert r["token_ids"] == _expected(nixl_reference, a["model"], prompt_ids), (a["name"], r)
        assert r["usage"]["cached_tokens"] == len(prompt_ids) - 1, a["name"]
        assert r["prefill"] is not None
    for m in ("alpha", "beta"):  # each decoder pulled its own lease
        assert wait_for_nixl_event(url, m, "pull", pulls[m] + 1) == pulls[m] + 1, m


def test_a_lease_that_ran_out_is_answered_privately_and_counted(nixl_app, nixl_reference):
    """A real lease from the base, aged past its end before the decoder's replica takes it (the
    second of two prompts' leases hits the prefix cache the first one filled): the decoder must
    prefill privately (the private reference's tokens), never decode from released
    blocks, and /metrics counts it as ``fallback:lease_expiring``. Neither lease is pulled, so both
    run out on the base's engine for real: vLLM's own expiry counter, which the Prefill replica pushes
    with its other vllm:* metrics, shows them on /metrics."""
    from ray import serve

    from app.sampling import Sampling
    from app.training.tasks import render_prompt
    from deployments.messages import DecodeRequest, PrefillRequest

    tok, _ = nixl_reference
    url = nixl_app["url"]
    prompt_ids = tuple(tok(render_prompt(CONTEXT, "what is the color?"))["input_ids"])
    before = nixl_events(url, "alpha", "fallback:lease_expiring")
    expired_before = _metric(_metrics(url), EXPIRED, model_name="base")
    prefill = serve.get_deployment_handle("Prefill-base", APP).prefill
    # two prompts, as a 2-agent fan-out sends them: one lease each, the second prefill a prefix-cache hit
    ticket = prefill.remote(
        PrefillRequest(request_id="expired", prompts=(prompt_ids, prompt_ids), cache_salt="lease-test")).result()
    lease, second = ticket.leases
    assert lease.params.get("remote_block_ids") and second.params.get("remote_block_ids")  # kept for a pull
    assert lease.computed_tokens == len(prompt_ids)  # a fresh salt: nothing cached before
    assert second.computed_tokens <= TEST_ENGINE["block_size"]  # at most the last, partial block recomputed
    expired = replace(lease, expires_at=time.time() - 1)
    stream = serve.get_deployment_handle("Decode-alpha", APP).options(stream=True).generate.remote(
        DecodeRequest("expired-dec", prompt_ids, Sampling(max_tokens=MAX_NEW), lease=expired))
    chunks = list(stream)
    assert not any(c.error for c in chunks), chunks
    assert [t for c in chunks for t in c.delta_token_ids] == _expected(nixl_reference, "alpha", list(prompt_ids),
                                                                       private=True)
    assert chunks[-1].num_cached_tokens == 0  # nothing pulled
    assert wait_for_nixl_event(url, "alpha", "fallback:lease_expiring", before + 1) == before + 1
    # vLLM counts a lease it reclaims in the step that finds it ran out; its stat logger gets the count
    # with the engine's next outputs, so small prefills follow once the leases are over (their own
    # leases run out only after this loop's deadline, so they cannot add to the count)
    time.sleep(max(0.0, lease.expires_at + 1 - time.time()))
    expired, deadline = expired_before, lease.expires_at + 30
    while expired < expired_before + 2 and time.time() < deadline:
        prefill.remote(PrefillRequest(request_id=f"tick-{time.time()}", prompts=(prompt_ids[:8],),
                                      cache_salt="tick")).result()
        time.sleep(2)
        expired = _metric(_metrics(url), EXPIRED, model_name="base")
    assert expired >= expired_before + 2, (expired_before, expired)
