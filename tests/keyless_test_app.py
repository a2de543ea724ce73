"""The keyless test app: a Serve app without API keys, as a client that sends no key sees it.
Registered in tests/keyless_app/conftest.py for that package: the SDK and its examples
(test_sdk_e2e.py), the LoRA decode groups (test_lora_groups.py) and vLLM's own clients
(test_vllm_compat.py).

The base (one prefill replica, its engine also serving the in-engine LoRA decoders "ie0" and
"ie1"); "lookup" and "tool_call", full decoders that share its KV;
"verify", whose KV shape differs (3 KV heads: private prefill); and a LoRA decode group on the
base serving "ad0" and "prüf-ágent-1" (an agent name with a dash and non-ASCII letters), whose
large random B matrices visibly change the base's greedy tokens; "tmpl", tool_call's weights
rendered by a chat template of its own (TEMPLATE). Random weights of the shipped
shape, float32, so greedy answers compare with the transformers reference. It starts once, for
the first test that asks for it, and stops after the package's last test (an app start takes
minutes on 2 cores); each module's ``app_url`` waits until every engine answers /ready.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from serve_test_app import TEST_ENGINE

from bench.random_models import make_models, serve_app, wait_app_ready

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "checkpoints" / "tokenizer"
MAX_NEW = 6  # limits.max_tokens_default
ADAPTERS = ("ad0", "prüf-ágent-1")
IN_ENGINE = ("ie0", "ie1")  # the base module's in-engine LoRA decoders (lora_decoders)
ALORA, INVOCATION = "ia0", "<|check|>"  # and an Activated LoRA one (PEFT's alora_invocation_tokens)
# tmpl's chat template: the switches vLLM's chat route passes (continue_final_message, a kwarg) show in the prompt
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not (loop.last and continue_final_message is "
            "defined and continue_final_message) %}</{{ m.role }}>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}{% if shout %}!{% endif %}")


def invocation_ids() -> list[int]:
    from prefillshare.app.training.tokenizer import load_tokenizer

    return load_tokenizer(TOKENIZER).encode(INVOCATION, add_special_tokens=False)


@pytest.fixture(scope="package")
def keyless_models(tmp_path_factory):
    """The app's models, plus an adapter trained on another base ("foreign": refused by the build)."""
    from dataclasses import replace

    from bench.models import random_adapter
    from prefillshare.app.models.manifest import read_manifest, write_manifest
    from prefillshare.app.rendering import TEMPLATE_FILE, Renderer

    root = tmp_path_factory.mktemp("keyless")
    paths = make_models(root, {"lookup": (1, {}), "tool_call": (2, {}), "verify": (3, {"num_key_value_heads": 3}),
                               "tmpl": (2, {})})
    write_manifest(paths["tmpl"], replace(read_manifest(paths["tmpl"]), prompt=Renderer.chat(TEMPLATE).fmt))
    (paths["tmpl"] / TEMPLATE_FILE).write_text(TEMPLATE)
    for i, name in enumerate(ADAPTERS):  # B ~ N(0, 0.1): each adapter changes the base's greedy tokens its own way
        paths[name] = random_adapter(root / name, paths["base"], name, 8, seed=i + 1, b_std=0.1)
    for i, name in enumerate(IN_ENGINE):
        paths[name] = random_adapter(root / name, paths["base"], name, 8, seed=i + 11, b_std=0.1)
    paths[ALORA] = random_adapter(root / ALORA, paths["base"], ALORA, 8, seed=21, b_std=0.1)
    peft_config = json.loads((paths[ALORA] / "adapter_config.json").read_text())
    peft_config["alora_invocation_tokens"] = invocation_ids()
    (paths[ALORA] / "adapter_config.json").write_text(json.dumps(peft_config))
    other = make_models(root / "other", {}, base_seed=7)
    paths["foreign"] = random_adapter(root / "foreign", other["base"], "foreign", 8, seed=3)
    return paths


def keyless_config(paths: dict[str, Path], pool: str, group: dict | None = None, module: dict | None = None) -> dict:
    """The package app's config; ``group`` overrides fields of its LoRA group, ``module`` of its prefill
    module (the build tests)."""
    group = dict(group or {})
    in_engine = [{"name": a, "path": str(paths[a]), "rank": 8} for a in (*IN_ENGINE, ALORA)]
    adapters = group.pop("adapters", [{"name": a, "path": str(paths[a]), "rank": 8} for a in ADAPTERS])
    place = {"num_cpus": 0.25, "placement_group_bundles": [{"CPU": 0.25}]}
    dec = lambda name: {"name": name, "model": str(paths[name]), "engine": TEST_ENGINE, "placement": place}  # noqa: E731
    return {
        "tokenizer": str(TOKENIZER),
        "pool": {"path": pool, "capacity_bytes": "128MiB"},
        "limits": {"max_tokens_default": MAX_NEW, "max_tokens_cap": 64, "max_rounds": 3, "max_logprobs": 5},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "prefill_modules": [{"name": "base", "model": str(paths["base"]), "engine": TEST_ENGINE,
                             "placement": {"num_replicas": 1, "num_cpus": 0.5},
                             "lora_decoders": in_engine, "max_lora_rank": 8, **(module or {})}],
        # lookup is sized by Serve's autoscaler (held at one replica): its engine reports the engine-load
        # policy's signals, which /metrics and the dashboard show
        "decoders": [{**dec("lookup"), "placement": {**place, "autoscaling": {
                         "min_replicas": 1, "max_replicas": 1, "metrics_interval_s": 1,
                         "policy": {"policy_kwargs": {"inter_token_target_s": 0.5}}}}},
                     dec("tool_call"), dec("verify"),
                     {"name": "group", "model": str(paths["base"]), "engine": TEST_ENGINE, "placement": place,
                      "adapters": adapters, "max_lora_rank": 8, **group},
                     dec("tmpl")],
    }


@pytest.fixture(scope="package")
def keyless_app(keyless_models):
    from prefillshare.app.config import load_config

    pool_dir = f"/dev/shm/ps-keyless-{os.getpid()}"
    cfg = load_config(keyless_config(keyless_models, pool_dir))
    with serve_app(cfg, "ps-keyless", f"/tmp/rkl{os.getpid()}", pool_dir) as url:
        yield url


@pytest.fixture(scope="module")
def app_url(keyless_app):
    """The package's app as each module finds it: every engine answering /ready first."""
    wait_app_ready(keyless_app)
    return keyless_app
