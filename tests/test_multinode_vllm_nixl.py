"""Hand-over "vllm-nixl" across Ray nodes: the base's prefill engine on one raylet, a decoder with
other weights on another, the prompt KV pulled between them by vLLM's own NixlConnector.

The three-raylet cluster of tests/ray_cluster.py (head, prefill node, decode node). The prefill
module's bundle asks for ``prefill_node``, decoder alpha's for ``decode_node``, as the KubeRay
worker groups place them. There is no pool and no block server in this mode: each engine listens
for NIXL handshakes on its own port, and the decoder pulls the blocks its lease names from the
prefill engine. A completion and a two-agent fan-out must give ``app.reference``'s shared-KV
greedy tokens with every prompt token but the last pulled, one pull per decoder request, counted
on /metrics. Random weights of the shipped shape, float32. Run through scripts/test.sh
(loopback-only network namespace).
"""
from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from random_models import free_port, make_models, post_json
from ray_cluster import replica_nodes, start_cluster, wait_ready
from serve_test_app import TEST_ENGINE, nixl_events, wait_for_nixl_event

pytest.importorskip("nixl._api")

pytestmark = [pytest.mark.serve, pytest.mark.engine]

CONTEXT = "order\nname:omar\nitem:desk\nqty:7\ncity:rome\nday:fri\ncolor:plum\nnote:leave it at the side door"
MAX_NEW = 8


def _app_config(paths, pool_dir: str) -> dict:
    engine = {**TEST_ENGINE, "max_num_seqs": 4}
    return {
        "tokenizer": str(paths["tokenizer"]),
        "handover": "vllm-nixl",
        "pool": {"path": pool_dir, "capacity_bytes": "64MiB"},
        "limits": {"max_tokens_default": MAX_NEW, "max_tokens_cap": 64, "max_agents": 4},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "prefill_modules": [{"name": "base", "model": str(paths["base"]), "engine": engine,
                             "placement": {"num_cpus": 0, "placement_group_bundles": [{"prefill_node": 0.1}]}}],
        "decoders": [{"name": "alpha", "model": str(paths["alpha"]), "engine": engine,
                      "placement": {"num_cpus": 0, "placement_group_bundles": [{"decode_node": 0.1}]}}],
    }


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    import ray
    from ray import serve

    from app.config import load_config
    from deployments.application import build

    tag = os.getpid()
    tmp = f"/tmp/rmv{tag}"
    pool_dir = f"/dev/shm/ps-mnv-{tag}"
    os.environ["RAY_TMPDIR"] = tmp
    with ThreadPoolExecutor(1) as ex:  # the models are written while the raylets start
        models = ex.submit(make_models, tmp_path_factory.mktemp("models"), {"alpha": (11, {})}, 10)
        cluster, nodes = start_cluster()
    try:
        paths = models.result()
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(load_config(_app_config(paths, pool_dir))), name="ps", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, {"ps"})
        yield {"url": base, "paths": paths, "nodes": nodes}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(app):
    from transformers import AutoTokenizer

    from app.models.checkpoint import load_model

    tok = AutoTokenizer.from_pretrained(str(app["paths"]["tokenizer"]))
    return tok, {k: load_model(app["paths"][k], torch.float32) for k in ("base", "alpha")}


def test_prefill_and_decoder_run_on_their_nodes(app):
    nodes = replica_nodes()
    assert nodes["Prefill-base"] == {app["nodes"]["prefill"]}, nodes
    assert nodes["Decode-alpha"] == {app["nodes"]["decode"]}, nodes


def test_a_completion_and_a_fan_out_pull_the_bases_kv_across_nodes(app, reference):
    from app.reference import shared_greedy
    from app.training.tasks import render_prompt

    tok, models = reference
    url = app["url"]
    before = nixl_events(url, "alpha", "pull")

    def expected(instruction: str) -> tuple[list[int], list[int]]:
        ids = tok(render_prompt(CONTEXT, instruction))["input_ids"]
        return ids, shared_greedy(models["base"], models["alpha"], ids, MAX_NEW, tok.eos_token_id)

    prompt = render_prompt(CONTEXT, "what is the city?")
    status, out = post_json(url + "/v1/completions", {"model": "alpha", "prompt": prompt, "max_tokens": MAX_NEW,
                                                      "temperature": 0}, 300)
    assert status == 200, out
    ids, want = expected("what is the city?")
    assert out["choices"][0]["text"].rstrip("\ufffd") == tok.decode(want, skip_special_tokens=True).rstrip("\ufffd")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1, out["usage"]  # pulled

    agents = [{"name": "a", "model": "alpha", "instruction": "what is the item?", "max_tokens": MAX_NEW},
              {"name": "b", "model": "alpha", "instruction": "what is the day?", "max_tokens": MAX_NEW}]
    status, run = post_json(url + "/v1/agents/run", {"context": CONTEXT, "agents": agents}, 300)
    assert status == 200, run
    for r, a in zip(sorted(run["results"], key=lambda r: r["name"]), agents):
        ids, want = expected(a["instruction"])
        assert r["error"] is None, r
        assert r["token_ids"] == want, r
        assert r["usage"]["cached_tokens"] == len(ids) - 1, r["usage"]
    # one pull per decoder request: the completion's and each agent's own lease
    assert wait_for_nixl_event(url, "alpha", "pull", before + 3) == before + 3
