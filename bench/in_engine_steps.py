"""`python -m bench in-engine-steps`: where an in-engine engine's decode step spends its time, base vs adapters.

One vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profiler sees the model
runner) on the serving benchmark's random 12M Llama, holding N random rank-16 adapters as in-engine
decoders (the project's plugin active, as in the app). The same N prompts over one shared context
run twice, side by side: as N base requests, then as N adapter requests (one per adapter). Each
case is timed with 1 and with ``--output`` tokens out (the difference over the extra steps is the
decode step), and the adapters' decode is profiled (cProfile, self time per source file group):
what a step spends in vLLM's LoRA layers and ops against the rest of the model and the engine.
cProfile inflates Python-heavy code, so the split is also measured by wall clock: the adapters run
once more with the LoRA products (the plugin's add_lora_linear and sgmv ops) made no-ops, in this process only (wrong
tokens, right timing): adapters - that = the products; that - base = the rest of an adapter's cost
(vLLM's LoRA layers, the punica wrapper's per-step metadata, the plugin's per-step mapping).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source-file groups of a profile, first match wins
GROUPS = (("LoRA ops (the plugin's)", "prefillshare/app/engine/vllm_plugin"),
          ("LoRA ops (the plugin's)", "app/engine/vllm_plugin"),
          ("vLLM LoRA layers and punica wrapper", "vllm/lora/"),
          ("model forward (attention, MLP, norms)", "vllm/model_executor/"),
          ("attention backend", "vllm/v1/attention/"),
          ("model runner and input batch", "vllm/v1/worker/"),
          ("scheduler and KV cache manager", "vllm/v1/core/"),
          ("sampler", "vllm/v1/sample/"),
          ("torch (python side)", "torch/"))


def _group(filename: str) -> str:
    return next((label for label, part in GROUPS if part in filename), "other (engine loop, outputs, builtins)")


def _profile_groups(prof: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(prof)
    out: dict[str, float] = {}
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        out[_group(filename)] = out.get(_group(filename), 0.0) + tottime
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@contextlib.contextmanager
def _products_off():
    """The LoRA products as no-ops while inside (timing only: every token gets the base's output)."""
    from vllm.lora.punica_wrapper import punica_cpu

    owners = [(punica_cpu, n) for n in ("sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")]
    owners.append((punica_cpu.PunicaWrapperCPU, "add_lora_linear"))
    kept = [(owner, n, getattr(owner, n)) for owner, n in owners]
    for owner, n in owners:
        setattr(owner, n, lambda *a, **k: None)
    try:
        yield
    finally:
        for owner, n, f in kept:
            setattr(owner, n, f)


def run(args) -> dict:
    from bench.models import ModelShape, random_models

    shape = ModelShape(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                       intermediate=args.intermediate, max_position=8192)
    mset = random_models(Path(args.model_dir), args.fanout, shape, ROOT / "checkpoints" / "tokenizer",
                         args.dtype, lora_rank=args.rank)
    names = [f"agent{i}" for i in range(args.fanout)]
    from prefillshare.app.engine import vllm_plugin
    from prefillshare.app.prompt_split import Activation

    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       vllm_plugin.HANDOVER_ADAPTERS_ENV: vllm_plugin.adapters_env({n: Activation() for n in names}),
                       **vllm_plugin.HANDOVER_ENGINE_ENV})
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from prefillshare.app.engine.compute_dtype import resolve

    llm = LLM(model=mset.base, tokenizer=str(ROOT / "checkpoints" / "tokenizer"), dtype=resolve(args.dtype),
              enforce_eager=True, max_model_len=args.context + 256, block_size=32, enable_prefix_caching=True,
              kv_cache_memory_bytes=1 << 30, enable_lora=True, max_loras=args.fanout, max_cpu_loras=args.fanout,
              max_lora_rank=args.rank, seed=0)
    assert vllm_plugin.handover_adapters() == frozenset(names), "the plugin did not load in this engine"
    loras = [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(zip(names, mset.adapters))]
    rng = random.Random(0)
    result: dict = {"model": mset.description, "fanout": args.fanout, "context": args.context,
                    "output": args.output, "cases": {}}

    def prompts() -> list[dict]:  # a fresh shared context per run: nothing cached from the run before
        ctx = [rng.randrange(10, 500) for _ in range(args.context)]
        return [{"prompt_token_ids": ctx + [rng.randrange(10, 500) for _ in range(16)]} for _ in names]

    def timed(lora: list | None, max_tokens: int, prof: cProfile.Profile | None = None) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        batch = prompts()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        llm.generate(batch, params, lora_request=lora, use_tqdm=False)
        if prof is not None:
            prof.disable()
        return time.perf_counter() - t0

    timed(None, 2)  # warm-up
    timed(loras, 2)
    for case, lora, off in (("base", None, False), ("adapters", loras, False),
                            ("adapters, LoRA products off", loras, True)):
        with _products_off() if off else contextlib.nullcontext():
            first = min(timed(lora, 1) for _ in range(args.repeats))
            whole = min(timed(lora, args.output + 1) for _ in range(args.repeats))
        result["cases"][case] = {"prefill_s": round(first, 4),
                                 "decode_step_ms": round((whole - first) / args.output * 1e3, 2)}
        print(f"{case}: prefill of the fan-out {first * 1e3:.0f} ms, decode step "
              f"{result['cases'][case]['decode_step_ms']} ms ({args.fanout} sequences)", flush=True)
    for case, lora in (("base", None), ("adapters", loras)):
        prof = cProfile.Profile()
        spent = timed(lora, args.output + 1, prof)
        groups = _profile_groups(prof)
        total = sum(groups.values())
        result["cases"][case]["profile_self_s"] = {k: round(v, 3) for k, v in groups.items()}
        result["cases"][case]["profiled_wall_s"] = round(spent, 3)
        print(f"{case}, profiled ({spent:.2f} s wall):", flush=True)
        for k, v in groups.items():
            print(f"  {k}: {v:.3f} s ({100 * v / total:.0f}%)", flush=True)
    a, b = result["cases"]["adapters"], result["cases"]["base"]
    off = result["cases"]["adapters, LoRA products off"]
    result["decode_step_adapters_over_base"] = round(a["decode_step_ms"] / b["decode_step_ms"], 2)
    result["decode_step_split_ms"] = {
        "base": b["decode_step_ms"],
        "LoRA products (the plugin's LoRA linear and sgmv ops)": round(a["decode_step_ms"] - off["decode_step_ms"], 2),
        "the rest of the adapters' cost (LoRA layers, wrapper metadata, mapping)":
            round(off["decode_step_ms"] - b["decode_step_ms"], 2)}
    print(f"decode step, adapters / base: {result['decode_step_adapters_over_base']}x; split (ms): "
          f"{result['decode_step_split_ms']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fanout", type=int, default=4)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model-dir", default="runs/bench/in-engine-steps-models")
    p.add_argument("--out", help="JSON file for the figures")
    p.set_defaults(func=lambda a: run(a) and 0)
