"""`prefillshare bench {serve,engine,footprint,hops}`: the benchmark group of the command line.

Each benchmark module keeps its own ``configure(parser)``; this only wires them under one
``bench`` command and imports a module when its subcommand is chosen.
"""
from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "serve": ("app.bench.serve_bench", "PrefillShare vs per-model P/D vs colocated through the Serve app's HTTP API"),
    "engine": ("app.bench.engine_bench", "engine level: one shared prefill + N decoders vs N private prefills"),
    "footprint": ("app.bench.footprint", "engine memory, CPU and start-up: vLLM's worker process vs the worker inside EngineCore"),
    "hops": ("app.bench.hop_bench", "per-token cost of the Orchestrator's stream hop: decoder alone, relayed, completion path"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_) in BENCHES.items():
        p = sub.add_parser(name, help=help_, description=help_)
        importlib.import_module(module).configure(p)
