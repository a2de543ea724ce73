"""Prefill group on one Ray node, decoders on another, KV between them over NIXL.

A local three-raylet cluster (``ray.cluster_utils.Cluster``): the head (the Serve controller,
proxy and ingress deployments), a prefill node advertising ``prefill_node`` and a decode node
advertising ``decode_node``, the custom resources the KubeRay worker groups give their pods.
The app's typed config places the prefill replica and the KV block server on the prefill node,
decoder alpha on the decode node and one replica of decoder beta on each (both nodes offer one
``beta_slot``). Each node has its own pool folder (on one machine both would otherwise share
/dev/shm and NIXL would never run): decoders on the decode node miss locally, pull the run of
blocks from the prefill node's block server with one NIXL READ, keep it in their node's pool
for the other decoders, and load it; beta's replica on the prefill node reads that node's pool.
Random weights of the shipped shape, float32, so tokens compare with the transformers
reference. Run through scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl._api")

from random_models import free_port, make_models, post_json
from ray_cluster import DECODE_NODE, PREFILL_NODE, serving_cluster, wait_ready
from ray_cluster import get as _get
from ray_cluster import replica_nodes as _replica_nodes

pytestmark = [pytest.mark.serve, pytest.mark.engine]

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = "order\nname:omar\nitem:desk\nqty:7\ncity:rome\nday:fri\ncolor:plum\nnote:leave it at the side door"
MAX_NEW = 8
LONG_NEW = 600  # node loss: decoding outlasts the removal of a node
OUT = ROOT / "runs" / "multinode"


def _make_models(root: Path) -> dict[str, Path]:
    """A base and two decoders that declare it as their prefill module."""
    return make_models(root, {"alpha": (11, {}), "beta": (12, {})}, base_seed=10)


def _app_config(paths: dict[str, Path], pools: dict[str, str], kv_port: int) -> dict:
    engine = {"dtype": "float32", "max_model_len": 768, "kv_cache_memory_bytes": "128MiB", "block_size": 32,
              "max_num_seqs": 4, "threads_bind": "nobind"}
    # prefill and decode nodes offer Ray no CPU: only engines go there, the ingress stays on the head
    alpha = {"name": "alpha", "model": str(paths["alpha"]), "engine": engine,
             "placement": {"num_cpus": 0, "placement_group_bundles": [{"decode_node": 0.1}]}}
    # one beta_slot per node: a beta replica on the prefill node and one on the decode node
    beta = {"name": "beta", "model": str(paths["beta"]), "engine": engine,
            "placement": {"num_replicas": 2, "num_cpus": 0, "placement_group_bundles": [{"beta_slot": 1}]}}
    return {
        "tokenizer": str(paths["tokenizer"]),
        "pool": {"path": pools["prefill"], "decode_path": pools["decode"], "capacity_bytes": "128MiB",
                 "transport": "nixl", "nixl_listen": f"127.0.0.1:{kv_port}",
                 "nixl_peers": [f"127.0.0.1:{kv_port}"], "server_resources": {"prefill_node": 0.01}},
        "limits": {"max_tokens_default": MAX_NEW, "max_tokens_cap": LONG_NEW},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "prefill_modules": [{"name": "base", "model": str(paths["base"]), "engine": engine,
                             "placement": {"num_replicas": 1, "num_cpus": 0,
                                           "placement_group_bundles": [{"prefill_node": 0.1}]}}],
        "decoders": [alpha, beta],
    }


def _post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    return post_json(url, body, timeout)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from app.config import load_config
    from deployments.application import build
    from deployments.kv_server import build_kv_server

    tag = os.getpid()
    pools = {"prefill": f"/dev/shm/ps-mn-prefill-{tag}", "decode": f"/dev/shm/ps-mn-decode-{tag}"}
    # the models are written while the raylets start (which mostly wait for registration)
    with ThreadPoolExecutor(1) as ex:
        models = ex.submit(_make_models, tmp_path_factory.mktemp("models"))
        with serving_cluster("mn", tuple(pools.values())) as sc:
            paths = models.result()
            cfg = load_config(_app_config(paths, pools, free_port()))
            url = sc.serve({"kv": (build_kv_server(cfg), None), "ps": (build(cfg), "/")})
            yield {"url": url, "paths": paths, "cfg": cfg, "cluster": sc.cluster, "pools": pools, "nodes": sc.nodes}


@pytest.fixture(scope="module")
def reference(app):
    from transformers import AutoTokenizer

    from app.models.checkpoint import load_model

    tok = AutoTokenizer.from_pretrained(str(app["paths"]["tokenizer"]))
    models = {k: load_model(p, torch.float32) for k, p in app["paths"].items() if k != "tokenizer"}
    return tok, models


def _lose_node(cluster, node) -> None:
    """A node goes away as a machine does: every process on it at once. ``remove_node`` kills the
    raylet, but a worker only exits once it notices (and keeps streaming tokens to the Router
    meanwhile, actor to actor), so the node's replica processes are killed (SIGKILL, by pid) too;
    their engine cores die with them (app/engine/core_lifetime.py)."""
    import ray

    pids = [a["Pid"] for a in ray._private.state.actors().values()
            if a.get("State") == "ALIVE" and a["Address"]["NodeID"] == node.node_id and a.get("Pid")]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.remove_node(node, allow_graceful=False)


def _same_text(out: dict, expected_ids: list[int], tok) -> bool:
    """A completion equals the reference's greedy tokens: same count, same text. The server's
    detokenizer holds back a trailing incomplete UTF-8 sequence (byte-level tokens), which the
    reference decodes as U+FFFD, so trailing replacement characters are not compared."""
    want = tok.decode(expected_ids, skip_special_tokens=True).rstrip("\ufffd")
    return (out["usage"]["completion_tokens"] == len(expected_ids)
            and out["choices"][0]["text"].rstrip("\ufffd") == want)


def _pool_counters(path: str) -> dict[str, float]:
    from app.engine.kv_pool import KVPool

    return dict(KVPool.attach(path).stats().counters)


def test_prefill_group_and_decoders_land_on_their_nodes(app):
    nodes, want = _replica_nodes(), app["nodes"]
    assert nodes["Prefill-base"] == {want["prefill"]}, nodes
    assert nodes["KVBlockServer"] == {want["prefill"]}, nodes
    assert nodes["Decode-alpha"] == {want["decode"]}, nodes
    assert nodes["Decode-beta"] == {want["prefill"], want["decode"]}, nodes
    for name in ("Router", "Orchestrator", "Metrics"):  # the engine nodes offer no CPU: the ingress is on the head
        assert nodes[name] == {want["head"]}, nodes


def test_fan_out_across_nodes_matches_reference_and_moves_kv_over_nixl(app, reference):
    """Three agents over one context, sent at once: alpha twice on the decode node (KV pulled
    over NIXL), beta on the prefill node (its replica there is preferred)."""
    from app.plan import kv_bytes_per_token
    from app.reference import shared_greedy
    from app.training.tasks import render_prompt

    tok, models = reference
    before = _pool_counters(app["pools"]["decode"])
    agents = [("alpha", "what is the item?"), ("beta", "call the shipping tool."), ("alpha", "what is the city?")]
    prompts = [render_prompt(CONTEXT, instruction) for _, instruction in agents]
    with ThreadPoolExecutor(len(agents)) as ex:
        outs = list(ex.map(lambda a: _post(app["url"] + "/v1/completions",
                                           {"model": a[0], "prompt": a[1], "max_tokens": MAX_NEW, "temperature": 0}),
                           [(m, p) for (m, _), p in zip(agents, prompts)]))
    shared = 0
    for (model, _), prompt, (status, out) in zip(agents, prompts, outs):
        assert status == 200, out
        ids = tok(prompt)["input_ids"]
        expected = shared_greedy(models["base"], models[model], ids, MAX_NEW, tok.eos_token_id)
        assert _same_text(out, expected, tok), (model, out, tok.decode(expected, skip_special_tokens=True))
        # every prompt token but the last came from node 1's prefill
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1, (model, out["usage"])
        shared = max(shared, len(ids) - 1)
    after = _pool_counters(app["pools"]["decode"])
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # the decode node had none of it: alpha pulled over NIXL (the context's blocks once, then only
    # the blocks of each agent's own instruction that the node's pool did not hold yet)
    assert 1 <= delta.get("nixl_pulls", 0) <= sum(m == "alpha" for m, _ in agents), delta
    assert delta.get("nixl_errors", 0) == 0 and delta.get("nixl_damaged", 0) == 0, delta
    bpt = kv_bytes_per_token(app["paths"]["base"], "float32")
    assert delta["nixl_bytes"] >= shared * bpt, delta  # at least one whole prompt's KV crossed
    assert _pool_counters(app["pools"]["prefill"]).get("saves", 0) >= 1  # written on node 1
    pulled_tokens = delta["nixl_bytes"] / bpt
    figures = {"nixl_pulls": delta["nixl_pulls"], "nixl_bytes": delta["nixl_bytes"],
               "nixl_seconds": delta["nixl_seconds"], "kv_bytes_per_token": bpt,
               "us_per_token": delta["nixl_seconds"] / pulled_tokens * 1e6,
               "bytes_per_s": delta["nixl_bytes"] / max(delta["nixl_seconds"], 1e-9),
               "load_seconds": delta.get("load_seconds", 0.0), "load_tokens": delta.get("load_tokens", 0.0)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "nixl_fanout.json").write_text(json.dumps(figures, indent=1))
    print(f"\ncross-node KV over NIXL: {figures}")


def test_decoder_on_the_prefill_node_is_preferred_and_reads_its_local_pool(app, reference):
    """Beta has a replica on each node; the prefill ticket names its node and the decode router
    sends beta there, so the KV is read from the prefill node's pool and nothing crosses. Sent one
    at a time (equal queues): Serve's default router would pick the decode node's replica for
    about half of them, each a NIXL pull."""
    from app.reference import shared_greedy
    from app.training.tasks import render_prompt

    tok, models = reference
    decode_before = _pool_counters(app["pools"]["decode"])
    prefill_before = _pool_counters(app["pools"]["prefill"])
    loaded = 0
    for i in range(4):
        prompt = render_prompt(CONTEXT.replace("omar", f"near{i}"), "what is the qty?")
        ids = tok(prompt)["input_ids"]
        status, out = _post(app["url"] + "/v1/completions",
                            {"model": "beta", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0})
        assert status == 200, out
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1, out["usage"]
        expected = shared_greedy(models["base"], models["beta"], ids, MAX_NEW, tok.eos_token_id)
        assert _same_text(out, expected, tok), (out, tok.decode(expected, skip_special_tokens=True))
        loaded += len(ids) - 1
    decode_after = _pool_counters(app["pools"]["decode"])
    prefill_after = _pool_counters(app["pools"]["prefill"])
    pulls = decode_after.get("nixl_pulls", 0) - decode_before.get("nixl_pulls", 0)
    local_loads = prefill_after.get("load_tokens", 0) - prefill_before.get("load_tokens", 0)
    assert pulls == 0, (decode_before, decode_after)
    assert local_loads == loaded, (prefill_before, prefill_after)  # every prompt's KV loaded on the prefill node
    print(f"\nnode affinity: 4 beta requests, {loaded} tokens loaded from the prefill node's pool, {pulls} NIXL pulls")


def test_losing_the_prefill_node_falls_back_to_private_prefill_until_it_is_back(app, reference):
    """The prefill node's raylet dies (prefill replica, KV block server and beta's replica there
    with it). Requests keep being answered by the decode node's decoders, which prefill privately
    (tokens equal the decoder's own greedy run, nothing cached): the orchestrator waits at most
    ``prefill_wait_s`` for a prefill replica, and the decoders' pulls from the gone block server
    are misses. Once a new node offers ``prefill_node`` the group is placed there and prompts are
    shared again (L-1 tokens from the new prefill node, pulled over NIXL)."""
    from app.reference import private_greedy, shared_greedy
    from app.training.tasks import render_prompt

    tok, models = reference
    cluster, url = app["cluster"], app["url"]
    node = next(n for n in cluster.worker_nodes if n.node_id == app["nodes"]["prefill"])
    _lose_node(cluster, node)
    t0 = time.monotonic()
    for _ in range(120):  # the raylet is gone at once, its workers a little later: wait for the GCS to see them dead
        if not any(node.node_id in ns for ns in _replica_nodes().values()):
            break
        time.sleep(1)
    else:
        pytest.fail(f"replicas of the stopped prefill node are still alive: {_replica_nodes()}")
    dead_s = time.monotonic() - t0
    asks = [("alpha", render_prompt(CONTEXT.replace("omar", "gone0"), "what is the item?")),
            ("beta", render_prompt(CONTEXT.replace("omar", "gone1"), "what is the color?"))]
    with ThreadPoolExecutor(len(asks)) as ex:
        outs = list(ex.map(lambda a: _post(url + "/v1/completions", {"model": a[0], "prompt": a[1],
                                                                     "max_tokens": MAX_NEW}), asks))
    down_s = time.monotonic() - t0
    for (model, prompt), (status, out) in zip(asks, outs):
        assert status == 200, out
        ids = tok(prompt)["input_ids"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (model, out["usage"])
        expected = private_greedy(models[model], ids, MAX_NEW, tok.eos_token_id)
        assert _same_text(out, expected, tok), (model, out, tok.decode(expected, skip_special_tokens=True))
    fresh = cluster.add_node(**PREFILL_NODE)
    wait_ready(url, {"kv", "ps"})
    back_s = time.monotonic() - t0
    nodes = _replica_nodes()
    assert nodes["Prefill-base"] == nodes["KVBlockServer"] == {fresh.node_id}, nodes
    assert nodes["Decode-beta"] == {fresh.node_id, app["nodes"]["decode"]}, nodes
    app["nodes"]["prefill"] = fresh.node_id
    before = _pool_counters(app["pools"]["decode"])
    prompt = render_prompt(CONTEXT.replace("omar", "back"), "what is the day?")
    ids = tok(prompt)["input_ids"]
    status, out = _post(url + "/v1/completions", {"model": "alpha", "prompt": prompt, "max_tokens": MAX_NEW})
    assert status == 200, out
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1, out["usage"]
    expected = shared_greedy(models["base"], models["alpha"], ids, MAX_NEW, tok.eos_token_id)
    assert _same_text(out, expected, tok), (out, tok.decode(expected, skip_special_tokens=True))
    assert _pool_counters(app["pools"]["decode"]).get("nixl_pulls", 0) > before.get("nixl_pulls", 0)
    figures = {"replicas_seen_dead_after_s": round(dead_s, 1), "answered_privately_while_down_s": round(down_s, 1),
               "shared_again_after_s": round(back_s, 1)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "prefill_node_loss.json").write_text(json.dumps(figures, indent=1))
    print(f"\nprefill node loss: {figures}")


def _stream(url: str, body: dict, started: threading.Event, got: dict, timeout: float = 900) -> dict:
    """One streamed completion read to its end into ``got`` (filled as the events come, so a
    caller can read how far it is): the token chunks' count, the finish reason, the in-band
    error, if any. ``started`` is set when the first token arrives."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    got.update(tokens=0, finish_reason=None, error=None, done=False)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                got["error"] = event["error"]
                continue
            choice = event["choices"][0]
            if choice.get("text"):
                got["tokens"] += 1
                started.set()
            got["finish_reason"] = choice.get("finish_reason") or got["finish_reason"]
    return got


def test_losing_the_decode_node_fails_in_flight_requests_clearly_then_recovers(app, reference):
    """Runs last: node 2 goes away during traffic, then a fresh decode node joins.

    Alpha's streams are cut while their tokens flow (node 2 is lost once one of them has sent a
    token; each asks for 600 tokens, ignoring EOS, so none can finish first): each ends
    with an OpenAI-shaped error event, then [DONE]. Alpha's whole answers that had no output yet
    when the node went are repeated once (``decoder_retry``) and are served once node 3 is up;
    any that had output fail with a 5xx. So every request sent is answered: completed + failed
    = sent, none is lost. While no node offers ``decode_node`` the decoders cannot be placed
    and /ready says so; once a new node offers it Serve places them there and new requests
    succeed. Beta's requests go to its replica on the prefill node and complete throughout.
    """
    from app.reference import shared_greedy
    from app.training.tasks import render_prompt

    tok, models = reference
    cluster, url = app["cluster"], app["url"]
    node2 = next(n for n in cluster.worker_nodes if n.node_id == app["nodes"]["decode"])
    long = {"max_tokens": LONG_NEW, "ignore_eos": True}
    streams = [{"model": "alpha", "prompt": render_prompt(CONTEXT.replace("omar", f"flow{i}"), "what is the item?"),
                **long} for i in range(2)]
    whole = [{"model": m, "prompt": render_prompt(CONTEXT.replace("omar", f"user{i}"), "what is the item?"), **long}
             for i, m in enumerate(("alpha", "beta", "beta"))]
    started = threading.Event()
    with ThreadPoolExecutor(len(streams) + len(whole)) as ex:
        progress = [{} for _ in streams]
        cut = [ex.submit(_stream, url + "/v1/completions", b, started, p) for b, p in zip(streams, progress)]
        futures = [ex.submit(_post, url + "/v1/completions", b, 900) for b in whole]
        assert started.wait(600), [f.result() for f in cut if f.done()]
        _lose_node(cluster, node2)
        tokens_before_loss = [p.get("tokens", 0) for p in progress]
        for _ in range(120):  # the controller notices the dead replicas; they cannot be placed again
            status, body = _get(url + "/ready")
            if status == 503:
                break
            time.sleep(1)
        assert status == 503, body
        answered_while_down = sum(f.done() for f in futures)
        node3 = cluster.add_node(**DECODE_NODE)
        for _ in range(600):  # waiting for the decoders' engines to start on node 3
            status, _ = _get(url + "/ready")
            if status == 200:
                break
            time.sleep(1)
        assert status == 200, _get(url + "/ready")
        outcomes = [f.result() for f in futures]
        streamed = [f.result() for f in cut]
    # a stream that had sent tokens is never repeated (the client has them): it ends in-band;
    # one that had not is repeated once on the new node and ends whole
    for before, s in zip(tokens_before_loss, streamed):
        assert s["done"], s
        if before:
            # docs/reliability.md "Errors": a dead replica is code engine_error, its message says which
            assert s["finish_reason"] != "length" and s["error"], (before, s)
            assert s["error"]["code"] == "engine_error" and s["error"]["message"].startswith("decoder_unavailable"), s
        else:
            assert (s["error"] is None and s["finish_reason"] == "length") or s["error"]["message"], s
    assert any(tokens_before_loss), (tokens_before_loss, streamed)
    assert all(s == 200 for b, (s, _) in zip(whole, outcomes) if b["model"] == "beta"), outcomes
    completed = [o for s, o in outcomes if s == 200]
    failed = [(s, o) for s, o in outcomes if s != 200]
    assert len(completed) + len(failed) == len(whole)  # accepted = completed + failed
    for status, out in failed:
        assert status in (500, 502, 503, 504) and out["error"]["message"], (status, out)
    for out in completed:
        assert out["usage"]["completion_tokens"] == LONG_NEW, out["usage"]
    nodes = _replica_nodes()
    assert nodes["Decode-alpha"] == {node3.node_id}, nodes
    assert nodes["Decode-beta"] == {app["nodes"]["prefill"], node3.node_id}, nodes
    prompt = render_prompt(CONTEXT, "what is the day?")
    ids = tok(prompt)["input_ids"]
    status, out = _post(url + "/v1/completions", {"model": "beta", "prompt": prompt, "max_tokens": MAX_NEW})
    assert status == 200, out
    expected = shared_greedy(models["base"], models["beta"], ids, MAX_NEW, tok.eos_token_id)
    assert _same_text(out, expected, tok), (out, tok.decode(expected, skip_special_tokens=True))
    counts = {"streams_cut": sum(bool(b) for b in tokens_before_loss),
              "streams": len(streamed), "whole_sent": len(whole), "completed": len(completed),
              "failed": len(failed), "failed_status": sorted(s for s, _ in failed),
              "answered_while_node_down": answered_while_down}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "node_loss.json").write_text(json.dumps(counts, indent=1))
    print(f"\nnode loss: {counts}")
