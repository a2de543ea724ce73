"""PEFT's Activated LoRA adapters served in-engine, unmodified, in a real vLLM engine (float32).

Four adapters made with PEFT's own aLoRA support (bench/alora.py), each with its own
invocation string, are one engine's in-engine adapters (``EngineConfig.handover_adapters``); the
same weights without the invocation (ordinary LoRA) are served beside them. Checked: each
adapter's greedy tokens equal PEFT's ``generate()`` on four prompts, one of which holds the
invocation twice; the ordinary-LoRA copy answers otherwise (the activation point matters); a prompt
without the invocation is refused naming the model and the sequence; a fan-out of the four over
one long context computes that context once (vLLM's prefix-cache counters), and a base request
afterwards reads it from the cache. One engine, in a spawned child (tests/engine_child.py); PEFT's
references run here.
"""
from __future__ import annotations

import pytest

from bench import alora as alora_adapters
from bench.alora import ADAPTERS, CKPT
from tests.engine_child import KV_CACHE_BYTES, run_in_child

MAX_NEW = 8
BLOCK = 32
MAX_MODEL_LEN = 1024
CONTEXT_TOKENS = 850  # the fan-out's shared context: at least this long (the shipped base has 1,024 positions)
pytestmark = pytest.mark.engine


def _counter(name: str) -> float:
    """A vLLM counter's total over its series in this process's Prometheus registry."""
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == name)


def _serve(model: str, adapters: list[tuple[str, str]], alora: list[str], cases: dict, fan: dict, queue) -> None:
    """In the child: one engine and every request the tests check; puts what they read on ``queue``."""
    import asyncio

    from prefillshare.app.engine.async_engine import Engine, EngineConfig
    from prefillshare.app.sampling import Sampling

    cfg = EngineConfig(model=model, dtype="float32", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
                       block_size=BLOCK, lora_adapters=tuple(tuple(a) for a in adapters), max_lora_rank=8,
                       handover_adapters=tuple(alora), request_timeout_s=300)
    greedy = Sampling(max_tokens=MAX_NEW, temperature=0.0)

    async def run() -> dict:
        engine = await Engine.start(cfg)
        out: dict = {}
        try:
            def complete(prompt, lora=None, salt=None):
                return engine.complete(prompt, greedy, cache_salt=salt, lora=lora)

            # each adapter's prompts as aLoRA and as its ordinary-LoRA copy, at once: steps mix the two
            jobs = [(lora, name, p) for name, prompts in cases.items() for p in prompts
                    for lora in (name, f"{name}-plain")]
            done = await asyncio.gather(*[complete(p, lora, "short") for lora, _, p in jobs])
            out["short"] = [[lora, p, c.token_ids] for (lora, _, p), c in zip(jobs, done)]
            try:
                await complete(fan["missing"], alora[0])
                out["missing"] = None
            except Exception as e:  # noqa: BLE001 - the test reads what was raised
                out["missing"] = [type(e).__name__, str(e)]
            # the fan-out: each adapter over the context + its invocation, sent at once in a fresh tenant
            queries, hits = _counter("vllm:prefix_cache_queries_total"), _counter("vllm:prefix_cache_hits_total")
            fanned = await asyncio.gather(*[complete(p, n, "fan") for n, p in fan["prompts"].items()])
            out["fanned"] = {"tokens": {n: c.token_ids for n, c in zip(fan["prompts"], fanned)},
                          "queried": _counter("vllm:prefix_cache_queries_total") - queries,
                          "hit": _counter("vllm:prefix_cache_hits_total") - hits}
            base = await complete(fan["base"], None, "fan")
            out["base"] = {"cached": base.num_cached_tokens, "tokens": base.token_ids}
        finally:
            engine.shutdown()
        return out

    queue.put(asyncio.run(run()))


def _cases(tok) -> tuple[dict[str, list[list[int]]], dict]:
    """Per adapter four prompts holding its invocation (the third twice, the fourth not at the end),
    and the fan-out's prompts: one long context, then each adapter's invocation."""
    inv = {n: alora_adapters.invocation_ids(tok, n) for n in ADAPTERS}
    texts = [tok.encode(t, add_special_tokens=False)[:60] for t in alora_adapters.texts(40, seed=7)]
    bos = [tok.bos_token_id]
    cases = {}
    for k, n in enumerate(ADAPTERS):
        a, b, c, d, e = texts[5 * k: 5 * k + 5]
        cases[n] = [bos + a + inv[n], bos + b + inv[n], bos + c + inv[n] + d + inv[n], bos + e + inv[n] + a[:5]]
    context = bos
    for t in texts[20:]:
        context = context + t
        if len(context) >= CONTEXT_TOKENS:
            break
    assert len(context) + 8 <= MAX_MODEL_LEN - MAX_NEW
    fan = {"prompts": {n: context + inv[n] for n in ADAPTERS}, "base": context + inv[next(iter(ADAPTERS))],
           "context": len(context), "missing": bos + texts[0]}
    return cases, fan


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("alora")
    paths = alora_adapters.train(out)
    plain = {n: alora_adapters.as_plain_lora(p, out / f"{n}-plain") for n, p in paths.items()}
    return paths, plain


@pytest.fixture(scope="module")
def served(trained):
    from prefillshare.app.training.tokenizer import load_tokenizer

    paths, plain = trained
    cases, fan = _cases(load_tokenizer(CKPT / "base"))
    adapters = [(n, str(p)) for n, p in paths.items()] + [(f"{n}-plain", str(p)) for n, p in plain.items()]
    out = run_in_child(_serve, str(CKPT / "base"), adapters, list(paths), cases, fan)
    return {**out, "cases": cases, "fan": fan}


def test_each_adapter_generates_pefts_own_tokens(trained, served):
    paths, _ = trained
    for name, prompts in served["cases"].items():
        got = [t for lora, _, t in served["short"] if lora == name]
        want = alora_adapters.peft_greedy(paths[name], prompts, MAX_NEW)
        assert got == want, (name, got, want)


def test_the_same_weights_as_ordinary_lora_answer_otherwise(served):
    aloras = {(lora, tuple(p)): t for lora, p, t in served["short"] if not lora.endswith("-plain")}
    differ = [(lora, t) for lora, p, t in served["short"]
              if lora.endswith("-plain") and t != aloras[(lora.removesuffix("-plain"), tuple(p))]]
    assert differ


def test_a_prompt_without_the_invocation_is_refused_naming_the_model_and_the_sequence(served):
    kind, message = served["missing"]
    first = next(iter(ADAPTERS))
    assert kind == "InvocationMissing" and repr(first) in message and "invocation sequence" in message


def test_a_fan_out_computes_the_context_once_and_the_base_reads_it_afterwards(trained, served):
    fan, got = served["fan"], served["fanned"]
    one = len(next(iter(fan["prompts"].values())))
    computed = got["queried"] - got["hit"]  # vLLM's counters: prompt tokens looked up, and found
    assert got["queried"] >= sum(map(len, fan["prompts"].values())) and computed <= 1.1 * one, (got, one)
    assert served["base"]["cached"] == fan["context"] // BLOCK * BLOCK  # every block wholly before the invocation
    paths, _ = trained
    for name, prompt in fan["prompts"].items():
        assert got["tokens"][name] == alora_adapters.peft_greedy(paths[name], [prompt], MAX_NEW)[0]
