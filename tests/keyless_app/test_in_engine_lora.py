"""In-engine LoRA decoders: a prefill module's own engine serves cache-conditioned adapters of its base.

The package's Serve app (tests/keyless_test_app.py) gives its prefill module "base" two in-engine
decoders, "ie0" and "ie1" (random adapters whose large B matrices visibly change the base's greedy
tokens), beside full decoders that read the base's KV through the pool. Build checks run without
engines: an adapter trained naively (not cache-conditioned), or on another base, fails the build
naming its field. Through the app, every route gives each in-engine decoder the transformers
reference of the hand-over (base KV of prompt[:-1], then base + adapter), read from the module's
own prefix cache.
"""
from __future__ import annotations

import json
import shutil

import pytest
from keyless_test_app import ALORA, IN_ENGINE, INVOCATION, MAX_NEW, invocation_ids, keyless_config

CONTEXT = "order\nname: ines\nitem: desk\nqty: 2\ncity: lima\nday: fri\nnote: leave it at the back door please"
# a context no other test sends: what is cached of it, the test's own requests computed
FRESH = "order\nname: tomas\nitem: chair\nqty: 5\ncity: kyiv\nday: mon\nnote: ring twice and wait by the gate"
AGENTS = [("ie0", "what is the city?"), ("ie1", "call the shipping tool."), ("lookup", "what is the city?"),
          ("ad0", "what is the item?")]
FIELD = r"prefill_modules\[0\]\.lora_decoders\[0\]"


@pytest.fixture(scope="module")
def models(keyless_models):
    return keyless_models


def _config(paths, module: dict | None = None) -> dict:
    return keyless_config(paths, "/dev/shm/unused", module=module)


def test_in_engine_decoders_plan_on_their_module_and_its_engine_runs_them_from_the_hand_over(models):
    from prefillshare.app.config import load_config
    from prefillshare.app.engine_args import engine_config
    from prefillshare.app.plan import plan_app

    cfg = load_config(_config(models))
    plan = plan_app(cfg)
    for name in IN_ENGINE:
        d = plan.decoder(name)
        assert d.in_engine and d.prefill_module == "base" and d.adapter == name and d.group is None, d
    assert not plan.decoder("ad0").in_engine and plan.decoder("ad0").group == "group"
    p = cfg.prefill_modules[0]
    ec = engine_config(cfg, p.model, p.engine, p.placement, None, p)
    served = (*IN_ENGINE, ALORA)
    assert [n for n, _ in ec.lora_adapters] == list(served) and ec.handover_adapters == served
    # each named to the engine's plugin with its activation rule: the hand-over point, or the invocation
    assert json.loads(ec.core_env["PREFILLSHARE_HANDOVER_ADAPTERS"]) == {"ie0": [], "ie1": [], ALORA: invocation_ids()}
    assert ec.engine_args().enable_lora and ec.max_loras == len(served)


def _naive(models, tmp_path):
    """ie0's weights with a manifest that says Full-FT: a naive LoRA, never trained on the base's KV."""
    from dataclasses import replace

    from prefillshare.app.models.manifest import read_manifest, write_manifest

    out = shutil.copytree(models["ie0"], tmp_path / "naive")
    m = read_manifest(out)
    write_manifest(out, replace(m, training={**m.training, "method": "full_ft"}))
    return out


@pytest.mark.parametrize("case, message", [
    ("naive", rf"{FIELD}\.path: adapter 'ie0' was trained 'full_ft', not cache-conditioned"),
    ("foreign_base", rf"{FIELD}\.path: adapter 'foreign' belongs to base .* the module's model"),
    ("full_weights", rf"{FIELD}\.path: .* is not an adapter-only decoder"),
    ("rank_above_max", rf"{FIELD}\.rank: 16 is above the module's max_lora_rank 8"),
    ("name_twice", r"decoders: name\(s\) \['lookup'\] served twice"),
    ("with_per_adapter_prefill", r"prefill_modules\[0\]\.lora_decoders: a per-adapter prefill module"),
])
def test_a_decoder_that_cannot_run_in_engine_fails_the_build_naming_the_field(models, tmp_path, case, message):
    from prefillshare.app.config import ConfigError, load_config
    from prefillshare.deployments.application import build

    ie0 = {"name": "ie0", "path": str(models["ie0"]), "rank": 8}
    module: dict = {}
    if case == "naive":
        module["lora_decoders"] = [{**ie0, "path": str(_naive(models, tmp_path))}]
    elif case == "foreign_base":
        module["lora_decoders"] = [{"name": "foreign", "path": str(models["foreign"]), "rank": 8}]
    elif case == "full_weights":  # a full decoder's checkpoint, with an adapter_config.json beside it
        full = shutil.copytree(models["lookup"], tmp_path / "full")
        shutil.copy(models["ie0"] / "adapter_config.json", full / "adapter_config.json")
        module["lora_decoders"] = [{**ie0, "path": str(full)}]
    elif case == "rank_above_max":
        module["lora_decoders"] = [{**ie0, "rank": 16}]
    elif case == "name_twice":
        module["lora_decoders"] = [{**ie0, "name": "lookup"}]
    elif case == "with_per_adapter_prefill":
        module["adapters"] = [{"name": "ad0", "path": str(models["ad0"]), "rank": 8}]
    with pytest.raises(ConfigError, match=message):
        build(load_config(_config(models, module)))  # raises before any deployment is bound


# --- through the app ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(models):
    """Greedy tokens of the hand-over in transformers: base KV of prompt[:-1] + the merged decoder."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from prefillshare.app.models.checkpoint import load_model
    from prefillshare.app.reference import private_greedy, shared_greedy
    from prefillshare.app.training.tasks import render_prompt

    tok = AutoTokenizer.from_pretrained(str(models["tokenizer"]))
    base = load_model(models["base"], torch.float32).eval()
    decoders = {"lookup": load_model(models["lookup"], torch.float32).eval()}
    for a in (*IN_ENGINE, "ad0"):
        decoders[a] = PeftModel.from_pretrained(load_model(models["base"], torch.float32),
                                                str(models[a])).merge_and_unload().eval()

    def expected(model: str, instruction: str, whole: bool = False, context: str = CONTEXT) -> tuple[list[int], list[int]]:
        """(prompt ids, greedy tokens); ``whole``: the adapter on every prompt token (no hand-over)."""
        ids = tok(render_prompt(context, instruction))["input_ids"]
        if whole:
            return ids, private_greedy(decoders[model], ids, MAX_NEW, tok.eos_token_id)
        return ids, shared_greedy(base, decoders[model], ids, MAX_NEW, tok.eos_token_id)

    return expected


def _metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.mark.serve
@pytest.mark.engine
def test_a_mixed_fan_out_gives_in_engine_and_handed_over_decoders_their_references(app_url, reference):
    """One agent run over in-engine decoders, a full decoder and a decode group's adapter: each
    answers its reference; the in-engine ones read the module's cache of the shared context."""
    import httpx

    body = {"context": CONTEXT, "agents": [{"model": m, "instruction": i} for m, i in AGENTS]}
    r = httpx.post(app_url + "/v1/agents/run", json=body, timeout=300)
    assert r.status_code == 200, r.text
    results = {x["name"]: x for x in r.json()["results"]}
    for model, instruction in AGENTS:
        ids, want = reference(model, instruction)
        got = results[model]
        assert got["error"] is None and got["token_ids"] == want, (model, got)
        assert got["prefill"]["module"] == "base", got
    for model, instruction in AGENTS[:2]:
        ids, _ = reference(model, instruction)
        # every full block before the hand-over point came from the module's prefix cache
        assert results[model]["usage"]["cached_tokens"] >= (len(ids) - 1) // 32 * 32 > 0, results[model]["usage"]
    # the hand-over matters: the adapter on every prompt token answers otherwise on one of them
    assert any(results[m]["token_ids"] != reference(m, i, whole=True)[1] for m, i in AGENTS[:2])


@pytest.mark.serve
@pytest.mark.engine
def test_in_engine_decoders_answer_on_the_openai_routes_and_stream(app_url, reference):
    import openai
    from transformers import AutoTokenizer

    from prefillshare.app.training.tasks import render_prompt
    from tests.keyless_test_app import TOKENIZER

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    oa = openai.OpenAI(base_url=app_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    listed = {m.id: json.loads(m.model_dump_json()) for m in oa.models.list().data}
    assert listed["ie0"].get("parent") == "base" and listed["ie0"].get("prefill_module") == "base"
    prompt = render_prompt(FRESH, AGENTS[1][1])
    ids, want = reference("ie1", AGENTS[1][1], context=FRESH)
    before = _metric(app_url, "vllm:prefix_cache_hits_total")
    first = oa.completions.create(model="ie0", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    assert first.choices[0].text == tok.decode(reference("ie0", AGENTS[1][1], context=FRESH)[1],
                                               skip_special_tokens=True)
    out = oa.completions.create(model="ie1", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].text == tok.decode(want, skip_special_tokens=True)
    # ie1 reads every full block before the hand-over point that ie0 computed: keyed as the base's
    assert out.usage.prompt_tokens == len(ids) and first.usage.prompt_tokens_details.cached_tokens == 0
    assert out.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 32 * 32 > 0
    streamed = "".join(c.choices[0].text for c in oa.completions.create(
        model="ie1", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True))
    assert streamed == out.choices[0].text
    import time

    deadline = time.monotonic() + 30  # the engines push vllm:* to /metrics every few seconds
    while _metric(app_url, "vllm:prefix_cache_hits_total") <= before and time.monotonic() < deadline:
        time.sleep(1)
    assert _metric(app_url, "vllm:prefix_cache_hits_total") > before  # vLLM's own counter saw the hits


@pytest.mark.serve
@pytest.mark.engine
def test_an_activated_lora_decoder_acts_from_its_invocation_as_peft_does_and_refuses_a_prompt_without_it(app_url,
                                                                                                       models):
    """ia0 (PEFT's aLoRA form) over a context ie0 has cached: it reads every block before its
    invocation from the module's cache, and answers PEFT's own generate(); without the invocation, 400."""
    import openai
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from prefillshare.app.models.checkpoint import load_model
    from prefillshare.app.prompt_split import last_occurrence
    from prefillshare.app.training.tasks import render_prompt
    from tests.keyless_test_app import TOKENIZER

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    oa = openai.OpenAI(base_url=app_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    context = render_prompt(FRESH.replace("kyiv", "oslo"), "is it ready?")
    oa.completions.create(model="ie0", prompt=context, max_tokens=1, temperature=0)  # the context, cached
    prompt = context + "\n" + INVOCATION
    ids = tok(prompt)["input_ids"]
    start = last_occurrence(ids, invocation_ids())
    assert start is not None and start >= 32
    peft = PeftModel.from_pretrained(load_model(models["base"], torch.float32), str(models[ALORA])).eval()
    with torch.no_grad():
        want = peft.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    out = oa.completions.create(model=ALORA, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert out.usage.prompt_tokens_details.cached_tokens == start // 32 * 32  # the base's blocks, up to the invocation
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            r = oa.completions.create(model=ALORA, prompt=context, max_tokens=MAX_NEW, temperature=0, stream=stream)
            list(r) if stream else None
        err = e.value.body if isinstance(e.value.body, dict) else {}
        assert e.value.status_code == 400 and err.get("param") == "prompt", e.value
        assert repr(ALORA) in err["message"] and str(invocation_ids()) in err["message"], err
