"""`python -m bench lora-ops`: vLLM's CPU LoRA ops against the plugin's, on the batches in-engine decoders make.

vLLM 0.32's CPU punica ops (``vllm.lora.ops.torch_ops.sgmv_shrink`` / ``sgmv_expand``) gather one
adapter matrix per token and read a token without an adapter (index -1) as the last adapter slot.
The project's vLLM plugin (app/engine/vllm_plugin.py) replaces them with one product per run of
tokens with the same adapter, none for a run without one. This measures both on one projection
(shrink then expand, as a LoRA linear layer runs them) for the batches an engine with in-engine
decoders schedules, side by side in one process, and checks what each computes for the base's
tokens. Then a whole decode step's LoRA linear layers (per transformer layer: q/k/v merged, o,
gate/up merged, down, as in the serving benchmark's model): vLLM's ``PunicaWrapperCPU.add_lora_linear``
(its per-slice loop) with its own ops, the same loop with the plugin's per-run ops, and the plugin's
fused layer step. Times are medians of ``--repeats`` runs; ratios are stock / plugin.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

# (label, runs of (tokens, adapter slot or -1)): the batches a step of an in-engine engine holds
BATCHES = {
    "base prefill chunk 2048 + 1 adapter decode token": ((2048, -1), (1, 0)),
    "an adapter's first step: 31 base tail tokens + its hand-over token": ((31, -1), (1, 2)),
    "16 decode tokens of 4 adapters": ((4, 0), (4, 1), (4, 2), (4, 3)),
    "an adapter's prompt of 2048 on every token (stock multi-LoRA prefill)": ((2048, 1),),
}


def _inputs(runs, hidden: int, out: int, rank: int, slots: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = sum(n for n, _ in runs)
    x = torch.randn(tokens, hidden, generator=g)
    a = torch.randn(slots, 1, rank, hidden, generator=g) / hidden ** 0.5
    b = torch.randn(slots, 1, out, rank, generator=g) / rank ** 0.5
    lengths = torch.tensor([n for n, _ in runs])
    starts = torch.cumsum(lengths, 0) - lengths
    indices = torch.tensor([i for _, i in runs])
    meta = (starts, lengths, indices, len(runs), int(lengths.max()), tokens)
    return x, a, b, meta


def _layer(ops, x, a, b, meta, out: int):
    """y = base output + (x @ A^T) @ B^T per token's adapter: shrink, then expand (add)."""
    import torch

    shrink, expand = ops
    buf = torch.zeros(x.shape[0], a.shape[2])
    shrink(x, a, buf, *meta, 1.0)
    y = torch.zeros(x.shape[0], out)
    expand(buf, b, y, *meta, True)
    return y


def _time(fn, repeats: int) -> float:
    fn()  # warm
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _step_layers(hidden: int, intermediate: int, layers: int, rank: int, slots: int, dtype):
    """The LoRA linears of one decode step: (A per slice, B per slice, output slices, input width)."""
    import torch

    g = torch.Generator().manual_seed(1)
    shapes = [((hidden, hidden // 4, hidden // 4), hidden), ((hidden,), hidden),
              ((intermediate, intermediate), hidden), ((hidden,), intermediate)] * layers
    return [(tuple(torch.randn(slots, 1, rank, inp, generator=g).to(dtype) / inp ** 0.5 for _ in outs),
             tuple(torch.randn(slots, 1, o, rank, generator=g).to(dtype) / rank ** 0.5 for o in outs), outs, inp)
            for outs, inp in shapes]


def _decode_step_rows(args) -> list[dict]:
    """A decode step's LoRA linears, each token with its own adapter: vLLM's loop with vLLM's ops,
    vLLM's loop with the plugin's per-run ops, the plugin's fused layer."""
    import torch
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper import punica_cpu

    from prefillshare.app.engine import vllm_plugin as plugin

    dtype = torch.bfloat16
    step = _step_layers(args.hidden, args.intermediate, args.layers, args.rank, args.slots, dtype)
    stock_linear, stock_ops = punica_cpu.PunicaWrapperCPU.add_lora_linear, {
        n: getattr(punica_cpu, n) for n in ("sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")}
    rows = []
    for tokens in args.decode_tokens:
        w = punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=max(64, tokens), max_batches=max(16, tokens),
                                        device="cpu")
        ids = [1 + t % args.slots for t in range(tokens)]  # one adapter per sequence, slots in turn
        w.update_metadata(LoRAMapping(tuple(ids), (1,), is_prefill=True), list(range(1, args.slots + 1)),
                          args.slots, 100)
        xs = {inp: torch.randn(tokens, inp).to(dtype) for _, _, _, inp in step}

        def run_step(linear, ops, out=None, w=w, xs=xs, tokens=tokens):
            for n, f in ops.items():
                setattr(punica_cpu, n, f)
            try:
                for a, b, outs, inp in step:
                    y = torch.zeros(tokens, sum(outs), dtype=dtype)
                    linear(w, y, xs[inp], a, b, 1.0, outs)
                    if out is not None:
                        out.append(y)
            finally:
                for n, f in stock_ops.items():
                    setattr(punica_cpu, n, f)

        per_run = {n: getattr(plugin, "_" + n) for n in stock_ops}
        cases = {"vLLM's loop, vLLM's ops": (stock_linear, stock_ops),
                 "vLLM's loop, the plugin's per-run ops": (stock_linear, per_run),
                 "the plugin's fused layer": (plugin._add_lora_linear, {})}
        outputs = {}
        for label, (linear, ops) in cases.items():
            outputs[label] = []
            run_step(linear, ops, outputs[label])
        times = {label: _time(functools.partial(run_step, linear, ops), args.repeats) for label, (linear, ops) in
                 cases.items()}
        ref = outputs["vLLM's loop, vLLM's ops"]
        diff = max(float((y - r).float().abs().max()) for y, r in zip(outputs["the plugin's fused layer"], ref))
        fused = times["the plugin's fused layer"]
        rows.append({"tokens": tokens, "linears": len(step), **{f"{k} ms": round(v * 1e3, 3) for k, v in times.items()},
                     "vLLM's over fused": round(times["vLLM's loop, vLLM's ops"] / fused, 2),
                     "per-run over fused": round(times["vLLM's loop, the plugin's per-run ops"] / fused, 2),
                     "fused max abs diff from vLLM's (bf16)": diff})
        print(f"decode step of {tokens} tokens, {len(step)} LoRA linears: "
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items())
              + f"; fused differs from vLLM's by {diff:.2e}", flush=True)
    return rows


def run(args) -> dict:
    from vllm.lora.ops import torch_ops

    from prefillshare.app.engine import vllm_plugin as plugin

    stock = (torch_ops.sgmv_shrink, torch_ops.sgmv_expand)
    ours = (plugin._sgmv_shrink, plugin._sgmv_expand)
    rows = []
    for label, runs in BATCHES.items():
        x, a, b, meta = _inputs(runs, args.hidden, args.hidden, args.rank, args.slots)
        y_stock, y_ours = _layer(stock, x, a, b, meta, args.hidden), _layer(ours, x, a, b, meta, args.hidden)
        base_rows = [r for (n, i), s in zip(runs, meta[0].tolist()) if i < 0 for r in range(s, s + n)]
        adapter_rows = [r for (n, i), s in zip(runs, meta[0].tolist()) if i >= 0 for r in range(s, s + n)]
        t_stock = _time(functools.partial(_layer, stock, x, a, b, meta, args.hidden), args.repeats)
        t_ours = _time(functools.partial(_layer, ours, x, a, b, meta, args.hidden), args.repeats)
        rows.append({
            "batch": label, "tokens": x.shape[0],
            "stock_ms": round(t_stock * 1e3, 3), "plugin_ms": round(t_ours * 1e3, 3),
            "stock_over_plugin": round(t_stock / t_ours, 2),
            # what each adds to a base token: the plugin nothing, stock the last slot's adapter
            "base_token_delta_stock": float(y_stock[base_rows].abs().max()) if base_rows else None,
            "base_token_delta_plugin": float(y_ours[base_rows].abs().max()) if base_rows else None,
            "adapter_rows_max_diff": float((y_stock[adapter_rows] - y_ours[adapter_rows]).abs().max()),
        })
        print(f"{label}: stock {t_stock * 1e3:.2f} ms, plugin {t_ours * 1e3:.2f} ms "
              f"({t_stock / t_ours:.1f}x); base tokens get {rows[-1]['base_token_delta_stock']} (stock) vs "
              f"{rows[-1]['base_token_delta_plugin']} (plugin); adapter rows differ by "
              f"{rows[-1]['adapter_rows_max_diff']:.2e}", flush=True)
    import torch

    result = {"shape": {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                        "rank": args.rank, "slots": args.slots},
              "threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows,
              "decode_step": _decode_step_rows(args)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=512, help="in and out features of the projection")
    p.add_argument("--intermediate", type=int, default=1408, help="MLP width (the decode step's gate/up, down)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers of the decode step")
    p.add_argument("--decode-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[4, 8],
                   help="tokens of the decode steps measured, e.g. 4,8")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=4, help="adapter slots (vLLM's max_loras)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", help="JSON file for the figures")
    p.set_defaults(func=lambda a: run(a) and 0)
