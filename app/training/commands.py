"""Command-line adapters for ``prefillshare data | train | eval`` (argparse in, library calls out)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from app.models.identity import CheckpointError
from app.models.manifest import METHODS, ManifestError
from app.training.tasks import AGENTS, DataError


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=int(os.environ.get("PREFILLSHARE_THREADS", "1")),
                   help="torch CPU threads (default 1, or $PREFILLSHARE_THREADS): on a busy 2-core machine "
                        "one thread avoids OpenMP spin-waiting behind other processes")


def set_threads(args) -> None:
    import torch

    torch.set_num_threads(max(1, args.threads))


def _fail(message: str) -> int:
    print(f"prefillshare: error: {message}", file=sys.stderr)
    return 2


# --- data ---
def configure_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/data", help="directory for train.jsonl and test.jsonl (default: runs/data)")
    p.add_argument("--contexts", type=int, default=3000, help="number of shared records (each asked by every agent)")
    p.add_argument("--test-fraction", type=float, default=0.1, help="share of records held out for test.jsonl")
    p.add_argument("--agents", default=",".join(AGENTS), help=f"comma-separated subset of: {', '.join(AGENTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_data)


def run_data(args) -> int:
    from app.training import tasks

    try:
        examples = tasks.make_examples(args.contexts, args.seed, [a for a in args.agents.split(",") if a])
    except ValueError as e:
        return _fail(str(e))
    train, test = tasks.split_examples(examples, args.test_fraction, args.seed)
    out = Path(args.out)
    tasks.write_jsonl(out / "train.jsonl", train)
    tasks.write_jsonl(out / "test.jsonl", test)
    print(f"wrote {len(train)} examples to {out / 'train.jsonl'} and {len(test)} to {out / 'test.jsonl'}")
    return 0


# --- train ---
def configure_train(p: argparse.ArgumentParser) -> None:
    p.description = ("Either run a whole recipe (--recipe all: tokenizer, data, base with retrieval gate, one "
                     "cache-conditioned decoder + Full-FT + layer-split baseline per agent, eval table), or "
                     "train one decoder (--base --data --agent --method --out).")
    p.add_argument("--recipe", choices=["all", "base"], help="all: regenerate every shipped model; base: only the base")
    p.add_argument("--models", default="checkpoints", help="recipe output root (default: checkpoints)")
    p.add_argument("--work", default="runs/recipe", help="recipe scratch dir: data, trainer states, logs")
    p.add_argument("--quick", action="store_true", help="recipe with tiny step counts (a smoke test, not the shipped models)")
    p.add_argument("--jobs", type=int, default=2, help="recipe: decoders trained in parallel processes (default 2)")
    p.add_argument("--base", help="prefill module checkpoint the decoder builds on")
    p.add_argument("--data", help="training JSONL (fields: agent, context, instruction, answer)")
    p.add_argument("--agent", help="which agent's examples to train on")
    p.add_argument("--method", choices=METHODS, default="cache_conditioned")
    p.add_argument("--out", help="output checkpoint directory (written whole, with prefillshare.json)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (merged into the exported weights)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--shared-layers", type=int, default=2, help="layer_split: lower layers kept from the base")
    p.add_argument("--state-dir", help="where resumable trainer state is kept (default: <out>.state)")
    p.add_argument("--resume", action="store_true", help="continue from --state-dir (or, with --recipe, skip finished models)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_threads_option(p)
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    from app.training.cache_conditioned import TrainConfig, train_decoder
    from app.training.recipe import DEFAULT_RECIPE, run_recipe
    from app.training.tasks import read_jsonl

    set_threads(args)
    try:
        if args.recipe:
            run_recipe(args.recipe, Path(args.models), Path(args.work), quick=args.quick, resume=args.resume,
                       progress=not args.no_progress, jobs=max(1, args.jobs), threads=max(1, args.threads))
            return 0
        missing = [f"--{k}" for k in ("base", "data", "agent", "out") if not getattr(args, k)]
        if missing:
            return _fail(f"train needs --recipe, or all of {', '.join(missing)}")
        d = DEFAULT_RECIPE.decoder
        cfg = TrainConfig(method=args.method, steps=args.steps or d.steps, batch_size=args.batch_size or d.batch_size,
                          lr=args.lr or d.lr, seed=args.seed, lora=args.lora, lora_rank=args.lora_rank,
                          shared_layers=args.shared_layers, warmup=d.warmup)
        examples = read_jsonl(args.data, known_agents=AGENTS)
        if args.agent not in {e.agent for e in examples}:
            return _fail(f"{args.data}: no examples for agent {args.agent!r}")
        state = args.state_dir or f"{args.out.rstrip('/')}.state"
        path = train_decoder(args.base, examples, args.agent, args.out, cfg, state_dir=state, resume=args.resume,
                             progress=not args.no_progress)
        print(f"wrote {path}")
        return 0
    except (DataError, ManifestError, CheckpointError, FileNotFoundError, ValueError) as e:
        return _fail(str(e))


# --- eval ---
def configure_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="JSONL file (fields: agent, context, instruction, answer)")
    p.add_argument("--models", default="checkpoints", help="root holding base/, decoders/, baselines/ (default: checkpoints)")
    p.add_argument("--out", help="output prefix for .json and .md (default: runs/eval/<data file stem>)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="at most this many examples per agent")
    add_threads_option(p)
    p.set_defaults(func=run_eval)


def run_eval(args) -> int:
    from app.training.evaluate import ModelSet, evaluate, to_markdown, write_results

    set_threads(args)
    try:
        result = evaluate(args.data, ModelSet.under(args.models), batch_size=args.batch_size, limit=args.limit)
    except (DataError, ManifestError, CheckpointError) as e:
        return _fail(str(e))
    out = Path(args.out) if args.out else Path("runs/eval") / Path(args.data).stem
    json_path, md_path = write_results(result, out)
    print(to_markdown(result))
    print(f"wrote {json_path} and {md_path}")
    return 0
