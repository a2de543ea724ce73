"""The two exports of a LoRA decoder agree: vLLM serving base + adapter generates the merged checkpoint's tokens.

One engine (the LoRA one); the merged checkpoint runs in transformers, whose greedy tokens
tests/test_shipped_models.py checks equal to vLLM's on a plain checkpoint.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from prefillshare.app.models.compat import check
from prefillshare.app.training import tasks
from prefillshare.app.training.tokenizer import load_tokenizer
from prefillshare.app.training.trainer import TrainConfig, train_decoder
from tests.engine_child import KV_CACHE_BYTES, run_in_child

CKPT = Path(__file__).resolve().parents[1] / "checkpoints"
pytestmark = pytest.mark.engine  # the shipped base is in the repository (checkpoints/): nothing to skip
MAX_NEW = 8


def _vllm_greedy(model: str, prompts: list[list[int]], adapter: str | None, queue) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora = dict(enable_lora=True, max_lora_rank=8, max_loras=1) if adapter else {}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              kv_cache_memory_bytes=KV_CACHE_BYTES, **lora)
    request = LoRARequest("decoder", 1, adapter) if adapter else None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW), lora_request=request)
    queue.put([list(o.outputs[0].token_ids) for o in outs])
    llm.llm_engine.engine_core.shutdown()  # the engine core is a non-daemon child


def _run(model: Path, prompts, adapter: Path | None = None) -> list[list[int]]:
    return run_in_child(_vllm_greedy, str(model), prompts, str(adapter) if adapter else None)


def test_merged_export_generates_the_adapter_models_greedy_tokens(tmp_path):
    """On the shipped (pretrained) base, whose answers are confident: a few LoRA steps teach the
    route agent's hub names; the bf16 merged checkpoint answers token for token like base + adapter."""
    base_dir = CKPT / "base"
    examples = tasks.make_examples(60, seed=8)
    out = train_decoder(base_dir, examples, "route", tmp_path / "merged",
                        TrainConfig(steps=8, batch_size=16, lr=5e-3, warmup=1, lora=True, lora_rank=8, save_every=0),
                        progress=False, adapter_out=tmp_path / "adapter")
    assert check(base_dir, tmp_path / "adapter").shared and check(base_dir, out).shared
    tok = load_tokenizer(base_dir)
    prompts = [tok(e.prompt)["input_ids"] for e in tasks.make_examples(6, seed=9) if e.agent == "route"]
    adapted = _run(base_dir, prompts, tmp_path / "adapter")  # vLLM: the base + the PEFT adapter
    from prefillshare.app.models.checkpoint import load_model
    from prefillshare.app.reference import private_greedy

    merged = load_model(out)  # the bf16 merged export, in transformers (the vLLM path is tested equal to it)
    assert adapted == [private_greedy(merged, p, MAX_NEW, tok.eos_token_id) for p in prompts]
    base = load_model(base_dir)
    assert adapted != [private_greedy(base, p, MAX_NEW, tok.eos_token_id) for p in prompts]  # the adapter changed them
