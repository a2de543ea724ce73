"""The shipped checkpoints: layout, size, manifests, and that vLLM loads and runs them."""
from __future__ import annotations

from pathlib import Path

import pytest

from prefillshare.app.models.compat import check
from prefillshare.app.models.manifest import read_manifest
from prefillshare.app.training import tasks
from tests.engine_child import KV_CACHE_BYTES, run_in_child

CKPT = Path(__file__).resolve().parents[1] / "checkpoints"
AGENTS = tuple(tasks.AGENTS)


def test_shipped_layout_manifests_and_size():
    from prefillshare.app.training.recipe import AGENT_SYSTEMS

    for agent in AGENTS:
        assert check(CKPT / "base", CKPT / "decoders" / agent).shared, agent
        assert read_manifest(CKPT / "baselines" / "fullft" / agent).method == "full_ft"
        assert read_manifest(CKPT / "baselines" / "layersplit" / agent).method == "layer_split"
        # shared-first with the agent's own system prompt, as the recipe trains them (the default
        # app's decoders share a framework-shaped fan-out: tests/test_sharing.py)
        for sub in ("decoders", "baselines/fullft", "baselines/layersplit"):
            prompt = read_manifest(CKPT / sub / agent).prompt
            assert (prompt.format, prompt.layout, prompt.system) == ("suite", "shared_first", AGENT_SYSTEMS[agent])
    total = sum(f.stat().st_size for f in CKPT.rglob("*") if f.is_file())
    assert total < 42 * 2**20, f"shipped checkpoints are {total / 2**20:.1f} MiB"


def test_shipped_chat_adapters_render_their_template_and_share_the_base():
    """checkpoints/chat: the chat-format suite's LoRA adapters (decoders and Full-FT baselines)."""
    from prefillshare.app.rendering import Renderer
    from prefillshare.app.training.tokenizer import load_tokenizer

    tok = load_tokenizer(CKPT / "base")
    systems = set()
    for agent in AGENTS:
        for path, method, layout in (
                (CKPT / "chat" / "adapters" / agent, "cache_conditioned", "shared_first"),
                (CKPT / "chat" / "baselines" / "fullft" / agent, "full_ft", "shared_first"),
                (CKPT / "chat" / "baselines" / "system_first" / agent, "cache_conditioned", "system_first")):
            m = read_manifest(path)
            assert m.method == method and m.agent == agent and m.weights == "adapter"
            assert m.prompt.format == "chat_template" and m.prompt.system and m.prompt.layout == layout
            systems.add(m.prompt.system)
            Renderer.for_decoder(path, m).check(tok, str(path))
        assert check(CKPT / "base", CKPT / "chat" / "adapters" / agent).shared, agent
    assert len(systems) == len(AGENTS)  # a system prompt of its own per agent


def _vllm_greedy(model: str, prompts: list[str], queue) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              kv_cache_memory_bytes=KV_CACHE_BYTES)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    queue.put([o.outputs[0].text for o in outs])
    # the engine core is a non-daemon child: without this the process never exits
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.engine
def test_vllm_loads_a_shipped_decoder_and_matches_transformers():
    """Private prefill in vLLM (float32) answers like the transformers path does."""
    from prefillshare.app.models.checkpoint import load_model
    from prefillshare.app.reference import private_greedy
    from prefillshare.app.training.tokenizer import load_tokenizer

    path = CKPT / "decoders" / "lookup"
    examples = [e for e in tasks.read_jsonl(CKPT / "data" / "test.jsonl") if e.agent == "lookup"][:4]
    prompts = [e.prompt for e in examples]
    texts = run_in_child(_vllm_greedy, str(path), prompts)
    tok, model = load_tokenizer(path), load_model(path)
    for text, prompt in zip(texts, prompts):
        ids = private_greedy(model, tok(prompt)["input_ids"], 16, tok.eos_token_id)
        want = tok.decode([t for t in ids if t != tok.eos_token_id])
        assert text == want
