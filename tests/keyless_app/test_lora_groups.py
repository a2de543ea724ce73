"""LoRA decode groups: one engine on the base serving several adapters, each on the base's KV.

Config-level checks run without engines; one engine-level test (two engines) checks per-adapter
KV (a prefill engine holding the adapters, as in b-lora): a bad adapter (no manifest, rank above the group's
max_lora_rank, more adapters than max_loras, another base, a rank the files contradict) fails
the build with the field named, before anything starts. The package's Serve app for the rest
(tests/keyless_app/conftest.py: the base's prefill, full-weight decoders such as "lookup" and a
group holding adapters "ad0" and "prüf-ágent-1" whose large random B matrices visibly change the
base's greedy tokens): every agent's tokens equal the transformers reference (base KV of
prompt[:-1] + the merged decoder) through /v1/agents/run, the openai client and the SDK. Run
through scripts/test.sh.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from keyless_test_app import ALORA, MAX_NEW, TOKENIZER, keyless_config

from tests.engine_child import CPU_TEST_ENGINE_ENV

CONTEXT = "order\nname: maya\nitem: lamp\nqty: 3\ncity: oslo\nday: tue\nnote: please call before noon"
AGENTS = [("lookup", "what is the city?"), ("ad0", "what is the city?"), ("prüf-ágent-1", "call the shipping tool.")]
GROUP = 3  # the LoRA group's index in the app's decoders (tests/keyless_app/conftest.py)


@pytest.fixture(scope="module")
def models(keyless_models):
    return keyless_models


def app_config(paths, group: dict | None = None) -> dict:
    return keyless_config(paths, "/dev/shm/unused", group)


# --- bad input: fails the build, names the field, starts nothing -------------------------------
def test_group_plan_serves_each_adapter_by_name_on_the_base_kv(models):
    from prefillshare.app.config import load_config
    from prefillshare.app.engine_args import engine_config
    from prefillshare.app.plan import plan_app

    cfg = load_config(app_config(models))
    plan = plan_app(cfg)
    by = {d.name: d for d in plan.decoders}
    assert set(by) == {"lookup", "tool_call", "verify", "ad0", "prüf-ágent-1", "tmpl", "ie0", "ie1", ALORA}
    assert by["lookup"].adapter is None and by["lookup"].prefill_module == "base"
    assert all(by[a].prefill_module == "base" and by[a].group == "group" and by[a].adapter == a for a in ("ad0", "prüf-ágent-1"))
    g = cfg.decoders[GROUP]
    ec = engine_config(cfg, g.model, g.engine, g.placement, None, g)
    assert [n for n, _ in ec.lora_adapters] == ["ad0", "prüf-ágent-1"] and ec.max_loras == 2 and ec.max_lora_rank == 8
    args = ec.engine_args()
    assert args.enable_lora and args.max_loras == 2


@pytest.mark.parametrize("case, field", [
    ("no_manifest", r"decoders\[3\]\.adapters\[0\]\.path: .*no prefillshare\.json"),
    ("foreign_base", r"decoders\[3\]\.adapters\[0\]\.path: adapter 'foreign' belongs to base"),
    ("rank_disagrees", r"decoders\[3\]\.adapters\[0\]\.rank: 1 in the config, the adapter's manifest says 8"),
    ("rank_above_max", r"decoders\[3\]\.adapters\[0\]\.rank: 16 is above the group's max_lora_rank 8"),
    ("too_many", r"decoders\[3\]\.adapters: 2 declared, the group allows max_loras=1"),
    ("not_a_dir", r"decoders\[3\]\.adapters\[0\]\.path: no adapter_config\.json"),
    ("name_twice", r"decoders: name\(s\) \['lookup'\] served twice"),
])
def test_a_bad_adapter_fails_the_build_naming_the_field(models, tmp_path, case, field):
    from prefillshare.app.config import ConfigError, load_config
    from prefillshare.deployments.application import build

    ad0 = {"name": "ad0", "path": str(models["ad0"]), "rank": 8}
    group: dict = {}
    if case == "no_manifest":
        bare = shutil.copytree(models["ad0"], tmp_path / "bare")
        (bare / "prefillshare.json").unlink()
        group["adapters"] = [{**ad0, "path": str(bare)}]
    elif case == "foreign_base":
        group["adapters"] = [{"name": "foreign", "path": str(models["foreign"]), "rank": 8}]
    elif case == "rank_disagrees":
        group["adapters"] = [{**ad0, "rank": 1}]
    elif case == "rank_above_max":
        group["adapters"] = [{**ad0, "rank": 16}]
    elif case == "too_many":
        group["max_loras"] = 1
    elif case == "not_a_dir":
        group["adapters"] = [{**ad0, "path": str(tmp_path)}]
    elif case == "name_twice":
        group["adapters"] = [{**ad0, "name": "lookup"}]
    with pytest.raises(ConfigError, match=field):
        build(load_config(app_config(models, group)))  # raises before any deployment is bound


# --- per-adapter KV (b-lora's prefill): engine level, two engines ----------------------------------
@pytest.mark.engine
def test_per_adapter_kv_is_loaded_only_by_its_own_adapter(models):
    """A prefill engine holding the adapters computes each adapter's prompt with it; keys carry the
    adapter, so the decode group's adapter loads its own KV (its private-prefill reference) and
    never another adapter's."""
    import asyncio
    import random

    import torch
    from peft import PeftModel

    from prefillshare.app.engine.async_engine import Engine, EngineConfig, Sampling
    from prefillshare.app.engine.pool.handover import connector_config
    from prefillshare.app.engine.pool.kv_pool import PoolSpec
    from prefillshare.app.models.checkpoint import load_model
    from prefillshare.app.models.identity import prefill_module_id
    from prefillshare.app.reference import shared_greedy

    pool = PoolSpec(path=f"/dev/shm/ps-lora-kv-{os.getpid()}", capacity_bytes=64 << 20)
    mid = prefill_module_id(models["base"])
    common = dict(dtype="float32", max_model_len=256, block_size=32, kv_cache_memory_bytes=128 << 20, max_num_seqs=8,
                  extra_env=CPU_TEST_ENGINE_ENV, max_loras=2,
                  lora_adapters=tuple((a, str(models[a])) for a in ("ad0", "prüf-ágent-1")))
    rng = random.Random(0)
    prompt, other = ([rng.randrange(3, 600) for _ in range(77)] for _ in range(2))

    async def run():
        prod = await Engine.start(EngineConfig(model=str(models["base"]), **common, kv_transfer_config=connector_config(
            "producer", mid, pool, adapter_keys=True)))
        cons = await Engine.start(EngineConfig(model=str(models["base"]), **common, kv_transfer_config=connector_config(
            "consumer", mid, pool, adapter_keys=True)))
        try:
            await asyncio.gather(*[prod.prefill(prompt, f"p{a}", kv_transfer_params={"fanout": 1}, lora=a)
                                   for a in ("ad0", "prüf-ágent-1")])
            outs = await asyncio.gather(*[cons.complete(prompt, Sampling(max_tokens=MAX_NEW), f"d{a}", lora=a)
                                          for a in ("ad0", "prüf-ágent-1")])
            await prod.prefill(other, "px", kv_transfer_params={"fanout": 1}, lora="prüf-ágent-1")
            cross = await cons.complete(other, Sampling(max_tokens=1), "dx", lora="ad0")
            with pytest.raises(Exception, match="ad9"):
                await cons.complete(prompt, Sampling(max_tokens=1), "dy", lora="ad9")
            return outs, cross
        finally:
            prod.shutdown()
            cons.shutdown()
            shutil.rmtree(pool.path, ignore_errors=True)

    outs, cross = asyncio.run(run())
    for a, out in zip(("ad0", "prüf-ágent-1"), outs):
        merged = PeftModel.from_pretrained(load_model(models["base"], torch.float32), str(models[a])).merge_and_unload()
        assert out.num_cached_tokens == len(prompt) - 1, a
        assert out.token_ids == shared_greedy(merged.eval(), merged, prompt, MAX_NEW), a
    assert cross.num_cached_tokens == 0  # prüf-ágent-1's KV is not ad0's


# --- the package's Serve app: references through every route ----------------------------------
@pytest.fixture(scope="module")
def reference(models):
    """Greedy tokens of the served path in transformers: base KV of prompt[:-1] + the merged decoder."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from prefillshare.app.models.checkpoint import load_model
    from prefillshare.app.reference import shared_greedy
    from prefillshare.app.training.tasks import render_prompt

    tok = AutoTokenizer.from_pretrained(str(models["tokenizer"]))
    base = load_model(models["base"], torch.float32).eval()
    decoders = {"lookup": load_model(models["lookup"], torch.float32).eval(), "base": base}
    for a in ("ad0", "prüf-ágent-1"):
        decoders[a] = PeftModel.from_pretrained(load_model(models["base"], torch.float32),
                                                str(models[a])).merge_and_unload().eval()

    def expected(model: str, instruction: str) -> tuple[list[int], list[int]]:
        ids = tok(render_prompt(CONTEXT, instruction))["input_ids"]
        return ids, shared_greedy(base, decoders[model], ids, MAX_NEW, tok.eos_token_id)

    return expected


@pytest.mark.serve
@pytest.mark.engine
def test_mixed_fan_out_gives_each_decoder_its_reference_on_the_base_kv(app_url, reference):
    import httpx

    body = {"context": CONTEXT, "agents": [{"model": m, "instruction": i} for m, i in AGENTS]
            + [{"name": "ad0-again", "model": "ad0", "instruction": AGENTS[2][1]}]}
    r = httpx.post(app_url + "/v1/agents/run", json=body, timeout=300)
    assert r.status_code == 200, r.text
    results = {x["name"]: x for x in r.json()["results"]}
    for name, (model, instruction) in {**{m: (m, i) for m, i in AGENTS}, "ad0-again": ("ad0", AGENTS[2][1])}.items():
        ids, want = reference(model, instruction)
        got = results[name]
        assert got["error"] is None and got["token_ids"] == want, (name, got)
        assert got["usage"]["cached_tokens"] == len(ids) - 1, (name, got["usage"])  # the base's KV, loaded
        assert got["prefill"]["module"] == "base"
    # the adapters visibly change the base's tokens, and differ from each other on the same prompt
    ids, base_only = reference("base", AGENTS[2][1])
    assert results["prüf-ágent-1"]["token_ids"] != base_only and results["ad0-again"]["token_ids"] != base_only
    assert results["prüf-ágent-1"]["token_ids"] != results["ad0-again"]["token_ids"]


@pytest.mark.serve
@pytest.mark.engine
def test_openai_client_and_sdk_address_adapters_like_models(app_url, reference):
    import httpx
    import openai
    from transformers import AutoTokenizer

    from prefillshare.agents import Agent, Client, ModelNotFoundError, Sampling
    from prefillshare.app.training.tasks import render_prompt

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    oa = openai.OpenAI(base_url=app_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    models = {m.id: m for m in oa.models.list().data}
    assert {"lookup", "ad0", "prüf-ágent-1"} <= set(models)
    adapter, full = (json.loads(models[m].model_dump_json()) for m in ("prüf-ágent-1", "lookup"))
    assert adapter.get("prefill_module") == "base"
    # an adapter names the decode group serving it, as vLLM's /v1/models does; a full decoder has none
    assert adapter.get("parent") == "group" and full.get("parent") is None
    assert adapter.get("max_model_len", 0) > 0
    for model in ("prüf-ágent-1", "lookup"):
        ids, want = reference(model, AGENTS[0][1])
        out = oa.completions.create(model=model, prompt=render_prompt(CONTEXT, AGENTS[0][1]), max_tokens=MAX_NEW,
                                    temperature=0)
        assert out.usage.prompt_tokens == len(ids)
        assert out.choices[0].text == tok.decode(want, skip_special_tokens=True), model
    with Client(app_url, timeout=300) as c:
        res = c.run(CONTEXT, [Agent(m, i, sampling=Sampling(max_tokens=MAX_NEW)) for m, i in AGENTS]).raise_for_errors()
        for m, i in AGENTS:
            assert list(res[m].token_ids) == reference(m, i)[1], m
        with pytest.raises(ModelNotFoundError):
            c.complete("ad9", "hello", max_tokens=2)
    r = httpx.post(app_url + "/v1/completions", json={"model": "ad9", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "ad9" in r.json()["error"]["message"]
