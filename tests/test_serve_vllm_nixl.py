"""The Serve application on hand-over "vllm-nixl": vLLM's NixlConnector between the base and two
decoders with other weights plus a LoRA decode group, real engines, over HTTP, across Ray nodes.

The three-raylet cluster of tests/ray_cluster.py (head, prefill node, decode node): the prefill
module's bundle asks for ``prefill_node``, every decoder's for ``decode_node``, as the KubeRay
worker groups place them. There is no pool and no block server in this mode: each engine listens
for NIXL handshakes on its own port, and a decoder pulls the blocks its lease names from the
prefill engine on the other raylet.

Random weights of the shipped shape (bench/random_models.py), float32 so that tokens compare with
the transformers reference. Completions and a 2-agent fan-out must give ``prefillshare.app.reference``'s
shared-KV greedy tokens with every prompt token but the last pulled from the base (one lease per
decoder); a lease that ran out before the decoder took its request must be answered with the
private reference's tokens and counted on /metrics. API keys are on, so every prefill carries the
tenant's cache salt, and so is the KV secret, so every NIXL handshake runs over CURVE
(app/engine/nixl/side_channel_auth.py; tests/test_side_channel_auth.py refuses peers without it). Run through scripts/test.sh (loopback-only network namespace).
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
from dataclasses import replace
from pathlib import Path

# NIXL is a dependency of this mode (scripts/setup.sh installs it): a broken install fails here, never skips
import nixl._api  # noqa: F401
import pytest
from hang_report import bounded
from ray_cluster import DECODE_NODE, PREFILL_NODE, replica_nodes, serving_cluster, wait_ready
from ray_cluster import get as _get
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
    prefill_call,
    wait_for_nixl_event,
)

from prefillshare.app.engine.nixl.kv_auth import KV_SECRET_ENV

pytestmark = [pytest.mark.serve, pytest.mark.engine]

CONTEXT = "order\nname:maya\nitem:lamp\nqty:3\ncity:oslo\nday:tue\ncolor:teal\nnote:please call before noon thanks"
APP = "psn"
LONG_NEW = 600  # node loss: decoding outlasts the removal of a node
ENGINE = {**TEST_ENGINE, "max_model_len": 768}
OUT = Path(__file__).resolve().parent.parent / "runs" / "multinode"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"  # vLLM's counter (nixl/stats.py), as its replica pushes it
REFUSED = "prefillshare_nixl_refused_handshakes_total"  # the side channel's refusals (prefillshare.app.engine.nixl.connector)


def _on(node: str, entry: dict, replicas: int = 1) -> dict:
    """A deployment entry placed on raylets advertising ``node``, as a KubeRay worker group's pods:
    ``beta_slot`` (one per node) puts one replica on each."""
    return {**entry, "engine": ENGINE, "placement": {"num_replicas": replicas, "num_cpus": 0,
                                                    "placement_group_bundles": [{node: 0.1 if replicas == 1 else 1}]}}


def _app_config(paths, pool_dir: str, keys_file) -> dict:
    return {
        "tokenizer": str(paths["tokenizer"]),
        "handover": "vllm-nixl",
        "pool": {"path": pool_dir, "capacity_bytes": "64MiB"},
        # the lease follows the request timeout (35 s): short enough for the expiry test to wait it out
        "limits": {"max_tokens_default": MAX_NEW, "max_tokens_cap": LONG_NEW, "max_agents": 4, "request_timeout_s": 30},
        "auth": {"keys_file": str(keys_file)},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "prefill_modules": [_on("prefill_node", {"name": "base", "model": str(paths["base"]), "engine": TEST_ENGINE})],
        "decoders": [_on("decode_node", decoder_entry(paths, "alpha")), _on("beta_slot", decoder_entry(paths, "beta"), replicas=2),
                     _on("decode_node", {**decoder_entry(paths, "base"), "name": "group", "max_lora_rank": 8,
                                         "adapters": [{"name": "ad0", "path": str(paths["ad0"]), "rank": 8}]})],
    }


@pytest.fixture(scope="module")
def nixl_app(tmp_path_factory):
    from bench.models import random_adapter
    from bench.random_models import make_models
    from prefillshare.app.config import load_config
    from prefillshare.deployments.application import build

    root = tmp_path_factory.mktemp("models")
    paths = make_models(root, {"alpha": (1, {}), "beta": (2, {})})
    # B ~ N(0, 0.1): the adapter changes the base's greedy tokens
    paths["ad0"] = random_adapter(root / "ad0", paths["base"], "ad0", 8, seed=1, b_std=0.1)
    pool_dir = f"/dev/shm/ps-nixl-test-{os.getpid()}"
    keys_file = tmp_path_factory.mktemp("auth") / "keys.yaml"
    keys_file.write_text(f"{KEY_A}: acme\n")
    cfg = load_config(_app_config(paths, pool_dir, keys_file))
    # the raylets, their workers and engines inherit it, as KubeRay pods get it from a Secret
    os.environ[KV_SECRET_ENV] = "test-kv-secret-" + "x" * 16
    try:
        with serving_cluster("sn", (pool_dir,)) as sc:
            url = sc.serve({APP: (build(cfg), "/")})
            yield {"url": url, "paths": paths, "nodes": sc.nodes, "cluster": sc.cluster}
    finally:
        os.environ.pop(KV_SECRET_ENV, None)


@pytest.fixture(scope="module")
def nixl_reference(nixl_app):
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from prefillshare.app.models.checkpoint import load_model

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
    for d in ("Decode-alpha", "Decode-group"):
        assert nodes[d] == {nixl_app["nodes"]["decode"]}, (d, nodes)
    assert nodes["Decode-beta"] == {nixl_app["nodes"]["prefill"], nixl_app["nodes"]["decode"]}, nodes
    for name in ("Router", "Orchestrator", "Metrics"):  # the engine nodes offer no CPU: the ingress is on the head
        assert nodes[name] == {nixl_app["nodes"]["head"]}, nodes


def test_completions_pull_the_bases_kv_and_match_the_shared_reference(nixl_app, nixl_reference):
    from prefillshare.app.training.tasks import render_prompt

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
    from prefillshare.app.training.tasks import render_prompt

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


def test_the_prefill_engines_side_channel_answers_only_holders_of_the_kv_secret(nixl_app, nixl_reference):
    """The base's engine listens where its leases say (``remote_host``, ``remote_port``): a plain
    ZMQ peer asking as vLLM's handshake does gets no NIXL metadata, and /metrics counts it
    (``prefillshare_nixl_refused_handshakes_total``, reported with the engine's next step); a CURVE
    peer holding the KV secret gets the engine's handshake payload."""
    import zmq
    from side_channel_peer import ask, peer

    from prefillshare.app.engine.nixl import side_channel_auth
    from prefillshare.deployments.messages import PrefillRequest

    tok, _ = nixl_reference
    url = nixl_app["url"]
    ids = tuple(tok("a short prompt for the side channel")["input_ids"])
    ticket = prefill_call(APP, "base", PrefillRequest(request_id="side-channel", prompts=(ids,),
                                                      cache_salt="side-channel"))
    params = ticket.handoffs[0].params
    path = f"tcp://{params['remote_host']}:{params['remote_port']}"
    refused_before = _metric(_metrics(url), REFUSED, model_name="base")

    with peer(path) as plain:
        assert ask(plain, 3000) is None
    refused, deadline = refused_before, time.time() + 60
    while refused < refused_before + 1 and time.time() < deadline:  # a step of the engine reports it
        prefill_call(APP, "base", PrefillRequest(request_id=f"tick-{time.time()}", prompts=(ids[:8],),
                                                 cache_salt="tick"))
        time.sleep(2)
        refused = _metric(_metrics(url), REFUSED, model_name="base")
    assert refused >= refused_before + 1, (refused_before, refused)
    keys = side_channel_auth.curve_keys(os.environ[KV_SECRET_ENV].encode())
    with side_channel_auth.curve_zmq_ctx(keys)(zmq.REQ, path) as sock:
        payload = ask(sock, 3000)
    assert payload and len(payload) > 100  # vLLM's encoded NixlHandshakePayload (agent metadata)


def test_a_lease_that_ran_out_is_answered_privately_and_counted(nixl_app, nixl_reference):
    """A real lease from the base, aged past its end before the decoder's replica takes it (the
    second of two prompts' leases hits the prefix cache the first one filled): the decoder must
    prefill privately (the private reference's tokens), never decode from released
    blocks, and /metrics counts it as ``fallback:lease_expiring``. Neither lease is pulled, so both
    run out on the base's engine for real: vLLM's own expiry counter, which the Prefill replica pushes
    with its other vllm:* metrics, shows them on /metrics."""
    from ray import serve

    from prefillshare.app.sampling import Sampling
    from prefillshare.app.training.tasks import render_prompt
    from prefillshare.deployments.messages import DecodeRequest, PrefillRequest

    tok, _ = nixl_reference
    url = nixl_app["url"]
    prompt_ids = tuple(tok(render_prompt(CONTEXT, "what is the color?"))["input_ids"])
    before = nixl_events(url, "alpha", "fallback:lease_expiring")
    expired_before = _metric(_metrics(url), EXPIRED, model_name="base")
    # two prompts, as a 2-agent fan-out sends them: one lease each, the second prefill a prefix-cache hit
    ticket = prefill_call(APP, "base", PrefillRequest(request_id="expired", prompts=(prompt_ids, prompt_ids),
                                                      cache_salt="lease-test"))
    lease, second = ticket.handoffs
    assert lease.params.get("remote_block_ids") and second.params.get("remote_block_ids")  # kept for a pull
    assert lease.computed_tokens == len(prompt_ids)  # a fresh salt: nothing cached before
    assert second.computed_tokens <= TEST_ENGINE["block_size"]  # at most the last, partial block recomputed
    expired = replace(lease, expires_at=time.time() - 1)
    request = DecodeRequest("expired-dec", prompt_ids, Sampling(max_tokens=MAX_NEW), handoff=expired)
    chunks = bounded(lambda: list(serve.get_deployment_handle("Decode-alpha", APP).options(stream=True)
                                  .generate.remote(request)), 120, "Decode-alpha.generate")
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
        prefill_call(APP, "base", PrefillRequest(request_id=f"tick-{time.time()}", prompts=(prompt_ids[:8],),
                                                 cache_salt="tick"))
        time.sleep(2)
        expired = _metric(_metrics(url), EXPIRED, model_name="base")
    assert expired >= expired_before + 2, (expired_before, expired)


# ---------------------------------------------------------------- node loss (destructive: these run last)

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


def _same_text(out: dict, reference, model: str, prompt_ids: list[int], private: bool = False) -> bool:
    """A completion's text equals the reference's greedy tokens. The server's detokenizer holds
    back a trailing incomplete UTF-8 sequence (byte-level tokens), which the reference decodes as
    U+FFFD, so trailing replacement characters are not compared."""
    tok, _ = reference
    want = tok.decode(_expected(reference, model, prompt_ids, private=private), skip_special_tokens=True)
    return out["choices"][0]["text"].rstrip("\ufffd") == want.rstrip("\ufffd")


def _shared_completion(url: str, reference, model: str, prompt: str) -> None:
    """A completion on the base's pulled KV: every prompt token but the last loaded, the shared
    reference's text."""
    tok, _ = reference
    ids = tok(prompt)["input_ids"]
    status, out = _post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_NEW,
                                                 "temperature": 0})
    assert status == 200, out
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1, out["usage"]
    assert _same_text(out, reference, model, ids), out


def test_losing_the_prefill_node_falls_back_to_private_prefill_until_it_is_back(nixl_app, nixl_reference):
    """The prefill node's raylet dies (the base's engine, whose blocks the leases name, and beta's
    replica there with it). Requests keep being answered by the decode node's decoders, which
    prefill privately (the decoder's own greedy tokens, nothing cached): the Orchestrator waits at
    most ``prefill_wait_s`` for a prefill replica. Once a new node offers ``prefill_node`` the group
    is placed there and prompts are shared again (every prompt token but the last pulled from the
    new prefill engine, a new NIXL handshake)."""
    from prefillshare.app.training.tasks import render_prompt

    tok, _ = nixl_reference
    cluster, url = nixl_app["cluster"], nixl_app["url"]
    node = next(n for n in cluster.worker_nodes if n.node_id == nixl_app["nodes"]["prefill"])
    _lose_node(cluster, node)
    t0 = time.monotonic()
    for _ in range(120):  # the raylet is gone at once, its workers a little later: wait for the GCS to see them dead
        if not any(node.node_id in ns for ns in replica_nodes().values()):
            break
        time.sleep(1)
    else:
        pytest.fail(f"replicas of the stopped prefill node are still alive: {replica_nodes()}")
    dead_s = time.monotonic() - t0
    asks = [("alpha", render_prompt(CONTEXT.replace("maya", "gone0"), "what is the item?")),
            ("beta", render_prompt(CONTEXT.replace("maya", "gone1"), "what is the color?"))]
    with ThreadPoolExecutor(len(asks)) as ex:
        outs = list(ex.map(lambda a: _post(url + "/v1/completions", {"model": a[0], "prompt": a[1],
                                                                     "max_tokens": MAX_NEW, "temperature": 0}), asks))
    down_s = time.monotonic() - t0
    for (model, prompt), (status, out) in zip(asks, outs):
        assert status == 200, out
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (model, out["usage"])
        assert _same_text(out, nixl_reference, model, tok(prompt)["input_ids"], private=True), (model, out)
    fresh = cluster.add_node(**PREFILL_NODE)
    wait_ready(url, {APP})
    back_s = time.monotonic() - t0
    nodes = replica_nodes()
    assert nodes["Prefill-base"] == {fresh.node_id}, nodes
    assert nodes["Decode-beta"] == {fresh.node_id, nixl_app["nodes"]["decode"]}, nodes
    nixl_app["nodes"]["prefill"] = fresh.node_id
    pulls = nixl_events(url, "alpha", "pull")
    _shared_completion(url, nixl_reference, "alpha", render_prompt(CONTEXT.replace("maya", "back"), "what is the day?"))
    assert wait_for_nixl_event(url, "alpha", "pull", pulls + 1) == pulls + 1
    figures = {"replicas_seen_dead_after_s": round(dead_s, 1), "answered_privately_while_down_s": round(down_s, 1),
               "shared_again_after_s": round(back_s, 1)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "prefill_node_loss.json").write_text(json.dumps(figures, indent=1))
    print(f"\nprefill node loss: {figures}")


def _stream(url: str, body: dict, started: threading.Event, got: dict, timeout: float = 900) -> dict:
    """One streamed completion read to its end into ``got`` (filled as the events come, so a
    caller can read how far it is): the token chunks' count, the finish reason, the in-band
    error, if any; a stream refused before its first event (an HTTP error status: a retry that
    outlived the request timeout) is answered too, with its status and JSON error. ``started`` is
    set when the first token arrives."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"})
    got.update(tokens=0, finish_reason=None, error=None, done=False, status=200)
    try:
        r = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        got.update(status=e.code, error=json.loads(e.read())["error"], done=True)
        return got
    with r:
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


def _promised_status(error: dict) -> int:
    """The one status docs/reliability.md ("Errors") promises for a failure of a request in flight when
    its decode node goes: 503 ``engine_error`` (the decoder unavailable) or 504 ``timeout`` (its retry
    outlived limits.request_timeout_s). Anything else, a 500 or 502 among them, fails the test."""
    from prefillshare.deployments.errors import HTTP, ErrorCode

    promised = {HTTP[c].code: HTTP[c].status for c in (ErrorCode.DECODER_UNAVAILABLE, ErrorCode.ENGINE_ERROR,
                                                        ErrorCode.TIMEOUT)}
    assert error.get("code") in promised and error.get("message"), error
    return promised[error["code"]]


def test_losing_the_decode_node_fails_in_flight_requests_clearly_then_recovers(nixl_app, nixl_reference):
    """Runs last: the decode node goes away during traffic, then a fresh decode node joins.

    Alpha's streams are cut while their tokens flow (the node is lost once one of them has sent a
    token; each asks for LONG_NEW tokens, ignoring EOS, so none can finish first): each ends
    with an OpenAI-shaped error event, then [DONE]. Alpha's whole answers that had no output yet
    when the node went are repeated once (``decoder_retry``) and are served once the new node is
    up, or fail with the one status their error code is documented with (503 ``engine_error``, 504
    ``timeout``; never a 500). So every request sent is answered: completed + failed = sent, none is
    lost. While no node offers ``decode_node`` alpha and the LoRA group cannot be placed and /ready says so; once a new node offers it Serve places them there and new requests
    succeed. Beta's requests may go to its replica on the prefill node and complete throughout.
    """
    from prefillshare.app.training.tasks import render_prompt

    tok, _ = nixl_reference
    cluster, url = nixl_app["cluster"], nixl_app["url"]
    node2 = next(n for n in cluster.worker_nodes if n.node_id == nixl_app["nodes"]["decode"])
    long = {"max_tokens": LONG_NEW, "ignore_eos": True}
    streams = [{"model": "alpha", "prompt": render_prompt(CONTEXT.replace("maya", f"flow{i}"), "what is the item?"),
                **long} for i in range(2)]
    whole = [{"model": m, "prompt": render_prompt(CONTEXT.replace("maya", f"user{i}"), "what is the item?"), **long}
             for i, m in enumerate(("alpha", "beta", "beta"))]
    started = threading.Event()
    counted = _metrics(url)
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
        for _ in range(600):  # waiting for the decoders' engines to start on the new node
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
        elif s["error"] is None:  # repeated once on the new node: whole
            assert s["status"] == 200 and s["finish_reason"] == "length", s
        else:  # or a typed error: in-band (200) once its stream had begun, else the status its code promises
            assert s["status"] in (200, _promised_status(s["error"])), s
    assert any(tokens_before_loss), (tokens_before_loss, streamed)
    completed = [o for s, o in outcomes if s == 200]
    failed = [(s, o) for s, o in outcomes if s != 200]
    # the Router's own account agrees with what the clients got: every completion the clients saw
    # whole is counted ok, every stream cut is counted an error
    whole_ok = len(completed) + sum(s["error"] is None for s in streamed)
    for _ in range(30):
        now = _metrics(url)
        grown = {status: sum(_metric(now, "prefillshare_requests_total", model=m, route="completions", status=status)
                             - _metric(counted, "prefillshare_requests_total", model=m, route="completions",
                                       status=status) for m in ("alpha", "beta"))
                 for status in ("ok", "error")}
        if grown["ok"] >= whole_ok and grown["error"] >= sum(map(bool, tokens_before_loss)):
            break
        time.sleep(1)
    assert grown["ok"] >= whole_ok and grown["error"] >= sum(map(bool, tokens_before_loss)), (grown, whole_ok)
    for status, out in failed:
        assert status == _promised_status(out["error"]), (status, out)
    for out in completed:
        assert out["usage"]["completion_tokens"] == LONG_NEW, out["usage"]
    nodes = replica_nodes()
    assert nodes["Decode-alpha"] == nodes["Decode-group"] == {node3.node_id}, nodes
    assert nodes["Decode-beta"] == {nixl_app["nodes"]["prefill"], node3.node_id}, nodes
    _shared_completion(url, nixl_reference, "alpha", render_prompt(CONTEXT, "what is the day?"))
    counts = {"streams_cut": sum(bool(b) for b in tokens_before_loss),
              "streams": len(streamed), "whole_sent": len(whole), "completed": len(completed),
              "failed": len(failed), "failed_status": sorted(s for s, _ in failed),
              "answered_while_node_down": answered_while_down}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "node_loss.json").write_text(json.dumps(counts, indent=1))
    print(f"\nnode loss: {counts}")
