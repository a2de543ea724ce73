"""In-engine LoRA decoders in a real vLLM engine: one engine on the shipped base (float32) serves the
four shipped chat adapters as hand-over adapters (``EngineConfig.handover_adapters``, which turns on
app/engine/vllm_plugin.py in its engine core).

Each adapter generates the transformers hand-over reference (the base's KV of prompt[:-1], then base +
adapter), which is not what the adapter generates over its whole prompt; the base's requests, in the
same batches, stay the base's; the adapters read the base's prefix-cache blocks up to the
hand-over point (sent after the base's request or with it), within a tenant (cache_salt) only; and
a full batch (max_num_seqs) of hand-over requests in prefill runs. One engine, in a spawned child
(tests/engine_child.py); the transformers references run here. The plugin's parts without an
engine, and the vLLM internals it relies on: tests/test_vllm_plugin.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine_child import KV_CACHE_BYTES, run_in_child

CKPT = Path(__file__).resolve().parents[1] / "checkpoints"
AGENTS = ("lookup", "tool_call", "reschedule", "route")
MAX_NEW = 8
BLOCK = 32
MAX_MODEL_LEN = 1024
LONG_TOKENS = 700  # the shared prompt of the fan-out: at least this long
pytestmark = pytest.mark.engine  # the base and the adapters are in the repository (checkpoints/): nothing to skip


def _name(agent: str) -> str:
    return f"chat-{agent}"


def _serve(model: str, adapters: list[tuple[str, str]], prompts: dict[str, list[list[int]]], long: list[int],
           queue) -> None:
    """In the child: one engine, every request the tests check; puts what they read on ``queue``."""
    import asyncio
    import time

    from prefillshare.app.engine.async_engine import Engine, EngineConfig
    from prefillshare.app.sampling import Sampling

    names = [n for n, _ in adapters]
    cfg = EngineConfig(model=model, dtype="float32", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
                       block_size=BLOCK, lora_adapters=tuple(tuple(a) for a in adapters), max_lora_rank=8,
                       handover_adapters=tuple(names), request_timeout_s=300)
    greedy = Sampling(max_tokens=MAX_NEW, temperature=0.0)

    async def run() -> dict:
        t0 = time.monotonic()
        engine = await Engine.start(cfg)
        out: dict = {"seconds": {"start": time.monotonic() - t0}}
        try:
            def complete(prompt, lora=None, salt=None):
                return engine.complete(prompt, greedy, cache_salt=salt, lora=lora)

            # per agent, its four prompts through the adapter and through the base, at once and
            # interleaved: the engine's steps mix base tokens and adapter tokens
            t = time.monotonic()
            out["short"] = []
            for agent in prompts:
                jobs = [job for p in prompts[agent] for job in ((_name(agent), p), (None, p))]
                done = await asyncio.gather(*[complete(p, lora) for lora, p in jobs])
                out["short"] += [[lora, p, c.token_ids] for (lora, p), c in zip(jobs, done)]
            out["seconds"]["short"] = time.monotonic() - t

            # the fan-out over one long prompt, after the base's request in the same tenant
            t = time.monotonic()
            base = await complete(long, salt="tenant-a")
            fan = await asyncio.gather(*[complete(long, n, "tenant-a") for n in names])
            out["after_base"] = {"base": base.num_cached_tokens, "cached": [c.num_cached_tokens for c in fan],
                                 "tokens": [c.token_ids for c in fan]}
            # the same, sent with the base's request at once (a fresh tenant: nothing cached yet)
            together = await asyncio.gather(complete(long, None, "tenant-c"),
                                            *[complete(long, n, "tenant-c") for n in names])
            out["concurrent"] = {"base": together[0].num_cached_tokens,
                                 "cached": [c.num_cached_tokens for c in together[1:]],
                                 "tokens": [c.token_ids for c in together[1:]]}
            # a second tenant: its first adapter request finds nothing of tenant-a's; its base request
            # then reads the blocks that adapter request computed before the hand-over point
            first = await complete(long, names[0], "tenant-b")
            base_b = await complete(long, None, "tenant-b")
            out["tenant_b"] = {"first": first.num_cached_tokens, "first_tokens": first.token_ids,
                               "base": base_b.num_cached_tokens, "base_tokens": base_b.token_ids}
            out["seconds"]["sharing"] = time.monotonic() - t

            # last (a failure here may end the engine): a full batch (max_num_seqs) of hand-over
            # requests in prefill at once, the sixteen prompts again in a fresh tenant
            t = time.monotonic()
            jobs = [(_name(agent), p) for agent in prompts for p in prompts[agent]]
            assert len(jobs) == cfg.max_num_seqs
            try:
                done = await asyncio.gather(*[complete(p, lora, "tenant-d") for lora, p in jobs])
                out["full_batch"] = [[lora, p, c.token_ids] for (lora, p), c in zip(jobs, done)]
            except Exception as e:  # noqa: BLE001 - the test names what failed
                out["full_batch"] = f"{type(e).__name__}: {e}"
            out["seconds"]["full_batch"] = time.monotonic() - t
        finally:
            engine.shutdown()
        return out

    queue.put(asyncio.run(run()))


def _prompts() -> tuple[dict[str, list[list[int]]], list[int]]:
    """Four rendered test conversations per agent (their last, assistant turn left out), and one
    long conversation: the user turns of several records, rendered as lookup's."""
    from prefillshare.app.rendering import Renderer
    from prefillshare.app.training.tokenizer import load_tokenizer

    tok = load_tokenizer(CKPT / "base")
    records = [json.loads(line) for line in (CKPT / "chat" / "data" / "test.jsonl").read_text().splitlines()]
    prompts = {}
    for agent in AGENTS:
        renderer = Renderer.for_decoder(CKPT / "chat" / "adapters" / agent)
        mine = [r for r in records if r["agent"] == agent][:4]
        prompts[agent] = [renderer.chat_ids(tok, [(m["role"], m["content"]) for m in r["messages"][:-1]])
                          for r in mine]
    renderer = Renderer.for_decoder(CKPT / "chat" / "adapters" / AGENTS[0])
    system = records[0]["messages"][0]["content"]
    for k in range(1, len(records)):
        user = "\n".join(r["messages"][1]["content"] for r in records[:k])
        long = renderer.chat_ids(tok, [("system", system), ("user", user)])
        if len(long) >= LONG_TOKENS:
            break
    assert LONG_TOKENS <= len(long) <= MAX_MODEL_LEN - MAX_NEW - BLOCK
    return prompts, long


@pytest.fixture(scope="module")
def served():
    prompts, long = _prompts()
    adapters = [(_name(a), str(CKPT / "chat" / "adapters" / a)) for a in AGENTS]
    out = run_in_child(_serve, str(CKPT / "base"), adapters, prompts, long)
    return {**out, "prompts": prompts, "long": long}


@pytest.fixture(scope="module")
def models():
    """The transformers references: the base, and each adapter merged into it."""
    from prefillshare.app.models.checkpoint import load_decoder, load_model
    from prefillshare.app.training.tokenizer import load_tokenizer

    base = load_model(CKPT / "base")
    decoders = {_name(a): load_decoder(CKPT / "chat" / "adapters" / a, CKPT / "base") for a in AGENTS}
    return base, decoders, load_tokenizer(CKPT / "base").eos_token_id


def test_each_adapter_generates_the_hand_over_reference(served, models):
    from prefillshare.app.reference import shared_greedy

    base, decoders, eos = models
    runs = [(lora, p, got) for lora, p, got in served["short"] if lora]
    assert len(runs) == len(AGENTS) * 4 and all(len(p) > BLOCK for _, p, _ in runs)
    wrong = [(lora, len(p), got, ref) for lora, p, got in runs
             if got != (ref := shared_greedy(base, decoders[lora], p, MAX_NEW, eos))]
    assert not wrong, wrong


def test_the_adapter_acting_on_the_whole_prompt_would_answer_otherwise(served, models):
    """The reference above is not the adapter over its whole prompt: the hand-over point matters."""
    from prefillshare.app.reference import private_greedy

    _, decoders, eos = models
    differ = [(lora, got) for lora, p, got in served["short"]
              if lora and got != private_greedy(decoders[lora], p, MAX_NEW, eos)]
    assert differ


def test_base_requests_batched_with_the_adapters_stay_the_bases(served, models):
    from prefillshare.app.reference import private_greedy

    base, _, eos = models
    runs = [(p, got) for lora, p, got in served["short"] if lora is None]
    assert len(runs) == len(AGENTS) * 4
    wrong = [(len(p), got, ref) for p, got in runs if got != (ref := private_greedy(base, p, MAX_NEW, eos))]
    assert not wrong, wrong


def _shared(long: list[int]) -> int:
    """The prompt tokens in full blocks wholly before the hand-over point (n-1): the base's blocks."""
    return (len(long) - 1) // BLOCK * BLOCK


def test_a_fan_out_after_the_base_reads_the_bases_blocks_up_to_the_hand_over_point(served, models):
    """Each adapter's first request on the prompt finds exactly the base's blocks: all those before
    the hand-over point, and not the one that holds it (the adapter computes that one itself)."""
    from prefillshare.app.reference import shared_greedy

    base, decoders, eos = models
    got, long = served["after_base"], served["long"]
    assert got["base"] == 0  # the tenant's first request
    assert got["cached"] == [_shared(long)] * len(AGENTS), (len(long), got["cached"])
    want = [shared_greedy(base, decoders[_name(a)], long, MAX_NEW, eos) for a in AGENTS]
    assert got["tokens"] == want


def test_a_fan_out_sent_with_the_bases_request_reads_its_blocks_too(served, models):
    """Measured: sent at once, the base's request is scheduled first and vLLM caches its prompt blocks
    when it allocates them, so the adapters find them as they do after the base has finished."""
    from prefillshare.app.reference import shared_greedy

    base, decoders, eos = models
    got, long = served["concurrent"], served["long"]
    assert (got["base"], got["cached"]) == (0, [_shared(long)] * len(AGENTS)), (len(long), got)
    assert got["tokens"] == [shared_greedy(base, decoders[_name(a)], long, MAX_NEW, eos) for a in AGENTS]


def test_another_tenant_shares_nothing_and_its_base_reads_its_adapters_early_blocks(served, models):
    from prefillshare.app.reference import private_greedy, shared_greedy

    base, decoders, eos = models
    got, long = served["tenant_b"], served["long"]
    assert got["first"] == 0  # tenant-a's blocks (base and adapters) are not tenant-b's
    assert got["first_tokens"] == shared_greedy(base, decoders[_name(AGENTS[0])], long, MAX_NEW, eos)
    # the adapter request computed the blocks before the hand-over point as the base: the base reads them
    assert got["base"] == _shared(long)
    assert got["base_tokens"] == private_greedy(base, long, MAX_NEW, eos)


def test_a_full_batch_of_hand_over_requests_in_prefill_runs(served):
    """max_num_seqs hand-over requests in one prefill step (each is two LoRA runs: none before the
    hand-over point, its adapter from there); their tokens are those they got in smaller batches."""
    got = served["full_batch"]
    assert not isinstance(got, str), f"the engine failed on a full batch of hand-over requests: {got}"
    assert got == [run for run in served["short"] if run[0]]
