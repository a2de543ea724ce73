"""Random-weight checkpoints of the shipped shape for the Serve tests, a free loopback port, and
one Serve app on a private Ray cluster (`serve_app`).

A base (the prefill module) and decoders whose manifests name it; a decoder given other
shape overrides (e.g. ``num_key_value_heads=3``) still names the base but cannot share its KV,
which exercises the private-prefill fallback. Peaked logits (initializer_range 0.08) keep
greedy ties unlikely, so tokens compare exactly with the transformers reference.
"""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.local_cluster import free_port

TOKENIZER = Path(__file__).resolve().parent.parent / "checkpoints" / "tokenizer"


def post_json(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """POST a JSON body; (status, JSON answer), errors included."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:  # not the app's JSON error (a proxy's page, a dying server)
            return e.code, {"error": {"message": raw.decode(errors="replace")}}


@contextmanager
def serve_app(cfg, name: str, ray_tmp: str, pool_dir: str) -> Iterator[str]:
    """Start a private Ray cluster (temp dir ``ray_tmp``), run the app built from ``cfg`` on a free
    loopback port, wait until every engine answers, yield its URL; stop it all and remove the pool."""
    import ray
    from ray import serve

    from prefillshare.deployments.application import build

    os.environ["RAY_TMPDIR"] = ray_tmp
    for attempt in range(5):  # the raylet has a fixed 30 s to register; a saturated 2-core box can miss it
        try:
            ray.init(num_cpus=4, include_dashboard=False, _temp_dir=ray_tmp)
            break
        except Exception:  # noqa: BLE001 - retried, then raised
            ray.shutdown()
            if attempt == 4:
                raise
            time.sleep(5)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(cfg), name=name, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_app_ready(url)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(pool_dir, ignore_errors=True)


def wait_app_ready(url: str) -> None:
    """Until every engine of the app at ``url`` answers /ready (its start, or a replacement's)."""
    from prefillshare.agents import Client

    with Client(url, retries=5, backoff_s=0.5) as c:
        c.wait_ready(timeout_s=600, interval_s=2)  # waiting for engines to start, not a timing assertion


def make_models(root: Path, decoders: dict[str, tuple[int, dict]], base_seed: int = 0) -> dict[str, Path]:
    """``decoders``: name -> (seed, config overrides). Returns paths of tokenizer, base, decoders."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from prefillshare.app.models.checkpoint import save_model
    from prefillshare.app.models.identity import prefill_module_id, tokenizer_hash
    from prefillshare.app.models.manifest import DecodeManifest
    from prefillshare.app.models.shapes import llama_config

    # a private copy: the shipped tokenizer may be rebuilt while a test runs
    paths = {"tokenizer": root / "tokenizer"}
    shutil.copytree(TOKENIZER, paths["tokenizer"])
    tok = AutoTokenizer.from_pretrained(str(paths["tokenizer"]))

    def model(seed: int, **over):
        cfg = llama_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        cfg.initializer_range = 0.08
        for k, v in over.items():
            setattr(cfg, k, v)
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)

    paths["base"] = save_model(model(base_seed), root / "base", paths["tokenizer"])
    base_id, tok_hash = prefill_module_id(paths["base"]), tokenizer_hash(paths["base"])
    for name, (seed, over) in decoders.items():
        manifest = DecodeManifest(name, base_id, tok_hash, {"method": "cache_conditioned"})
        paths[name] = save_model(model(seed, **over), root / name, paths["tokenizer"], manifest)
    return paths


def small_serve_config(paths: dict[str, Path], pool: str, port: int) -> dict:
    """A serve_config.yaml (as a dict) of the smallest app over :func:`make_models`' base and
    ``alpha``, on loopback ``port``: what `serve run` and a shutdown are timed and checked on."""
    engine = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": "64MiB", "block_size": 32,
              "max_num_seqs": 2, "threads_bind": "nobind"}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "stoptest", "route_prefix": "/", "import_path": "prefillshare.deployments.application:build_app",
                          "args": {"config": {
                              "tokenizer": str(paths["tokenizer"]),
                              "pool": {"path": pool, "capacity_bytes": "64MiB"},
                              "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
                              "prefill_modules": [{"name": "base", "model": str(paths["base"]), "engine": engine,
                                                   "placement": {"num_replicas": 1, "num_cpus": 0.25}}],
                              # threads_bind "0": vLLM runs the decoder's model in a VLLM::Worker process
                              # of its core (as on GPUs), which must not outlive the replica either;
                              # serving_niceness: its core and worker yield to starting engines once up
                              "decoders": [{"name": "alpha", "model": str(paths["alpha"]),
                                            "engine": {**engine, "threads_bind": "0", "serving_niceness": 19},
                                            "placement": {"num_cpus": 0.25}}],
                          }}}],
    }
