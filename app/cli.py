"""The ``prefillshare`` command. Each subcommand is one line in ``COMMANDS``.

A subcommand's module is imported only when that subcommand runs (or its ``--help`` is
asked for), so ``prefillshare --help`` stays fast and one broken import cannot take the whole
command down. The target is ``"module:function"``; the function receives the subcommand's
``argparse.ArgumentParser``, adds its arguments, and sets ``func`` (``args -> exit code``)
with ``parser.set_defaults(func=...)``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    target: str  # "module:configure_function"
    help: str


# The benchmarks and load runs are `python -m bench ...` from a source checkout (bench/, not installed).
COMMANDS: list[Command] = [
    Command("data", "prefillshare.app.training.commands:configure_data", "write the synthetic multi-agent task suite (JSONL)"),
    Command("train", "prefillshare.app.training.commands:configure_train", "pretrain the base / train decoders and baselines"),
    Command("eval", "prefillshare.app.training.commands:configure_eval", "score base, Full-FT, PrefillShare, naive reuse, layer-split"),
    Command("k8s", "prefillshare.app.kube.commands:configure", "render / validate the KubeRay RayService manifests, print a token Secret"),
    Command("capacity", "prefillshare.app.scaling:configure", "size prefill vs decode replicas, KV bandwidth and the bottleneck for a fan-out workload"),
    Command("pool-reclaim", "prefillshare.app.engine.pool.pool_owner:configure", "remove this node's KV pool folder of a config if no live process owns it (after a stop that killed its owners)"),
]


def _configure(command: Command, parser: argparse.ArgumentParser) -> None:
    module, func = command.target.split(":")
    try:
        configure = getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as e:  # the SDK alone is installed (`pip install prefillshare`)
        raise SystemExit(f"prefillshare {command.name}: needs the server, which is not installed ({e}); "
                                 "install it with an engine: pip install 'prefillshare[cpu]' (or [gpu])") from None
    configure(parser)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefillshare", description="PrefillShare on Ray Serve: one shared "
                                     "prefill module, many task-specific decode modules.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in (argv or []) if not a.startswith("-")), None)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if command.name == chosen:
            _configure(command, p)
    return parser


# Import names of the `server` extra's packages (pyproject.toml): the SDK alone lacks them.
SERVER_MODULES = {"ray", "torch", "vllm", "transformers", "tokenizers", "safetensors", "peft", "prometheus_client",
                  "pydantic", "yaml", "tqdm", "psutil"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2 if args.command is None else 1
        return int(args.func(args) or 0)
    except ModuleNotFoundError as e:  # the SDK alone is installed (`pip install prefillshare`)
        if (e.name or "").split(".")[0] not in SERVER_MODULES:
            raise
        raise SystemExit(f"prefillshare: this command needs the server, which is not installed (no module "
                         f"{e.name!r}); install it with an engine: pip install 'prefillshare[cpu]' (or [gpu])") from None


if __name__ == "__main__":
    sys.exit(main())
