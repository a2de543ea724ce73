"""``python -m bench COMMAND``: the benchmarks and load runs, one line each in ``COMMANDS``.

A command's module is imported only when that command runs (or its ``--help`` is asked for);
each module keeps its own ``configure(parser)``, which adds its arguments and sets ``func``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("bench.serve_bench", "PrefillShare vs per-model P/D vs colocated vs stock vLLM, side by side through HTTP"),
    "engine": ("bench.engine_bench", "engine level: one shared prefill + N decoders vs N private prefills"),
    "lora-ops": ("bench.lora_ops", "vLLM's CPU LoRA ops vs the plugin's on in-engine batches: time and what base tokens get"),
    "in-engine-eval": ("bench.in_engine_eval", "the chat suite's held-out exact match with its adapters served in-engine, beside the offline table"),
    "in-engine-steps": ("bench.in_engine_steps", "an in-engine engine's decode step, base vs adapters, side by side, with a profile"),
    "footprint": ("bench.footprint", "engine memory, CPU and start-up: vLLM's worker process vs the worker inside EngineCore"),
    "hops": ("bench.hop_bench", "per-token cost of the Orchestrator's stream hop: decoder alone, relayed, completion path"),
    "soak": ("bench.soak", "mixed fan-out/completion traffic for a fixed time: errors by code, p50/p95 per window, p95 drift"),
    "burst": ("bench.burst", "base load, a burst of several times it, base again: replicas over time per deployment, nothing lost"),
    "overload": ("bench.overload", "open-loop traffic at 2x the saturation rate with faults (kill -9, stalls): nothing lost, recovery, drift, leaks"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description="PrefillShare benchmarks and load runs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            importlib.import_module(module).configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if not getattr(args, "func", None):
        build_parser([]).print_help()
        return 2 if args.command is None else 1
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
