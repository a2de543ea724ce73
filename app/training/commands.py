"""Command-line adapters for ``prefillshare data | train | eval`` (argparse in, library calls out)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prefillshare.app.models.identity import CheckpointError
from prefillshare.app.models.manifest import METHODS, ManifestError
from prefillshare.app.training.tasks import AGENTS, DataError


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
    from prefillshare.app.training import tasks

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
                     "cache-conditioned decoder + Full-FT + layer-split baseline per agent, eval table; --recipe "
                     "chat: the chat-format suite with LoRA decoders), or train decoders for your own base and "
                     "data (--base --data [--agent NAME | --agent-field F] --out).")
    p.add_argument("--recipe", choices=["all", "base", "chat"],
                   help="all: regenerate every shipped model; base: only the base; chat: the chat-format suite (LoRA)")
    p.add_argument("--models", default="checkpoints", help="recipe output root (default: checkpoints)")
    p.add_argument("--work", default="runs/recipe", help="recipe scratch dir: data, trainer states, logs")
    p.add_argument("--quick", action="store_true", help="recipe with tiny step counts (a smoke test, not the shipped models)")
    p.add_argument("--jobs", type=int, default=2, help="recipe: decoders trained in parallel processes (default 2)")
    p.add_argument("--base", help="the prefill module: an HF checkpoint directory (config.json, weights, tokenizer)")
    p.add_argument("--data", help="training JSONL: chat {messages}, {prompt, completion}, or the suite's "
                   "{agent, context, instruction, answer}")
    p.add_argument("--agent", help="the agent (decoder) to train: lines whose agent field names it, and lines "
                   "without one; any name")
    p.add_argument("--agent-field", default="agent", help="JSON field naming a line's agent (default: agent); "
                   "without --agent, one decoder per agent found is written to --out/<agent>")
    p.add_argument("--eval-data", help="held-out JSONL (same format): loss evaluated during training")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate on --eval-data every N steps (default: off)")
    p.add_argument("--method", choices=METHODS, default="cache_conditioned")
    p.add_argument("--out", help="output checkpoint directory (written whole, with prefillshare.json)")
    p.add_argument("--chat-template", help="Jinja chat template file for messages/suite data (default: the base "
                   "tokenizer's own chat_template, if it has one)")
    p.add_argument("--no-chat-template", action="store_true", help="render without a chat template even if the "
                   "base tokenizer has one (the suite format)")
    p.add_argument("--system", help="system prompt agent requests get under a chat template (default: the one "
                   "every conversation of --data starts with, if shared)")
    p.add_argument("--layout", choices=["shared-first", "system-first"], default="shared-first",
                   help="where an agent's own text (system prompt, tools, its question) goes in the prompt: "
                   "shared-first (default): after the shared conversation, so agents with different system prompts "
                   "share one prefill of it; system-first: first, as chat templates put it (shares nothing across "
                   "agents whose system prompts differ)")
    p.add_argument("--max-length", type=int, default=None, help="prompt + answer tokens (default: the base's "
                   "max_position_embeddings); longer prompts lose context from the left (the last prompt token "
                   "and the answer always stay)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per micro-batch (default 8)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 2e-4 with --lora, 1e-5 full)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 autocast on a bf16 GPU, else float32")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations (keeps the prefix KV)")
    p.add_argument("--report-to", default="none", help="transformers report_to (e.g. tensorboard)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", action="store_true", help="train LoRA adapters: exports the merged model to --out "
                   "and the adapter alone to --adapter-out")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--invocation", help="with --lora: write PEFT's Activated LoRA form (alora_invocation_tokens): "
                   "this string ends every training prompt, the adapter acts from it on over the base's KV of what "
                   "precedes it, and only the adapter is written (to --adapter-out, else --out); serve it in-engine")
    p.add_argument("--adapter-out", help="with --lora: adapter-only export (PEFT + prefillshare.json; default "
                   "<out>-adapter)")
    p.add_argument("--shared-layers", type=int, default=2, help="layer_split: lower layers kept from the base")
    p.add_argument("--state-dir", help="where resumable trainer checkpoints are kept (default: <out>.state)")
    p.add_argument("--resume", action="store_true", help="continue from --state-dir (or, with --recipe, skip finished models)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_threads_option(p)
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    from prefillshare.app.rendering import RenderError
    from prefillshare.app.training.recipe import run_recipe

    set_threads(args)
    try:
        if args.recipe:
            run_recipe(args.recipe, Path(args.models), Path(args.work), quick=args.quick, resume=args.resume,
                       progress=not args.no_progress, jobs=max(1, args.jobs), threads=max(1, args.threads))
            return 0
        missing = [f"--{k}" for k in ("base", "data", "out") if not getattr(args, k)]
        if missing:
            return _fail(f"train needs --recipe, or all of {', '.join(missing)}")
        return _train_own(args)
    except (DataError, ManifestError, CheckpointError, RenderError, FileNotFoundError, ValueError) as e:
        return _fail(str(e))


def _train_own(args) -> int:
    """Decoders for the user's base and data: everything is checked and rendered before a model loads."""
    from prefillshare.app.models.identity import load_config_dict
    from prefillshare.app.training.data import choose_renderer, read_records, render_records
    from prefillshare.app.training.tokenizer import load_tokenizer
    from prefillshare.app.training.trainer import TrainConfig, train_decoder

    base = Path(args.base)
    base_cfg = load_config_dict(base)  # a base without config.json fails here, naming the directory
    if not any((base / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise CheckpointError(f"{base}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    # nothing longer than the base's positions can be served on its KV: the default cut
    positions = base_cfg.get("max_position_embeddings")
    if args.max_length and positions and args.max_length > positions:
        raise ValueError(f"--max-length {args.max_length} exceeds the base's max_position_embeddings {positions}")
    max_length = args.max_length or positions
    tok = load_tokenizer(base)
    records = read_records(args.data, args.agent, args.agent_field)
    renderer = choose_renderer(records, tok, args.chat_template, args.no_chat_template, args.system, args.data,
                               layout=args.layout.replace("-", "_"))
    invocation: tuple[int, ...] = ()
    if args.invocation is not None:
        if not args.lora:
            raise ValueError("--invocation needs --lora (an Activated LoRA adapter)")
        invocation = tuple(tok.encode(args.invocation, add_special_tokens=False))
        if not invocation:
            raise ValueError(f"--invocation {args.invocation!r} tokenizes to no tokens")
    train = render_records(records, tok, renderer, max_length, invocation)
    evals = []
    if args.eval_data:
        evals = render_records(read_records(args.eval_data, args.agent, args.agent_field), tok, renderer, max_length,
                               invocation)
    steps = args.steps or 300
    cfg = TrainConfig(method=args.method, steps=steps, batch_size=args.batch_size or 8, grad_accum=args.grad_accum,
                      lr=args.lr, warmup=args.warmup if args.warmup is not None else steps // 10, seed=args.seed,
                      lora=args.lora, lora_rank=args.lora_rank, shared_layers=args.shared_layers,
                      eval_every=args.eval_every, precision=args.precision,
                      gradient_checkpointing=args.gradient_checkpointing, max_length=max_length,
                      report_to=args.report_to, invocation=invocation)
    agents = [args.agent] if args.agent else list(dict.fromkeys(r.agent for r in records))
    for agent in agents:
        out = Path(args.out) if args.agent else Path(args.out) / agent
        adapter_out = None
        if args.lora:
            adapter_out = Path(args.adapter_out) / agent if args.adapter_out and not args.agent else \
                Path(args.adapter_out or (out if invocation else f"{str(out).rstrip('/')}-adapter"))
        state = Path(args.state_dir) / agent if args.state_dir and not args.agent else \
            Path(args.state_dir or f"{str(out).rstrip('/')}.state")
        path = train_decoder(base, train, agent, out, cfg, state_dir=state, resume=args.resume,
                             progress=not args.no_progress, renderer=renderer, eval_examples=evals,
                             adapter_out=adapter_out, tokenizer=tok)
        print(f"wrote {path} (agent {agent!r}, {sum(e.agent == agent for e in train)} examples, "
              f"prompt format {renderer.format})" + (f" and adapter {adapter_out}" if adapter_out and
                                                       adapter_out != path else ""))
    return 0


# --- eval ---
def configure_eval(p: argparse.ArgumentParser) -> None:
    p.description = ("Score base, Full-FT, PrefillShare, naive reuse and layer-split. Either the shipped layout "
                     "(--models ROOT, suite data, every agent) or one agent's checkpoints by path (--base B "
                     "--decoder D [--full-ft F] [--layer-split L], any subset; data in any training format).")
    p.add_argument("--data", required=True, help="JSONL file (suite, chat messages or prompt/completion)")
    p.add_argument("--models", default="checkpoints", help="root holding base/, decoders/, baselines/ (default: checkpoints)")
    p.add_argument("--base", help="the prefill module (switches to checkpoints by path)")
    p.add_argument("--decoder", help="cache-conditioned decoder (full or adapter-only): the prefillshare column")
    p.add_argument("--full-ft", help="Full-FT checkpoint: the full_ft and naive_reuse columns")
    p.add_argument("--layer-split", help="layer-split checkpoint: the layer_split column")
    p.add_argument("--agent-field", default="agent", help="JSON field naming a line's agent (default: agent)")
    p.add_argument("--out", help="output prefix for .json and .md (default: runs/eval/<data file stem>)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="at most this many examples per agent")
    add_threads_option(p)
    p.set_defaults(func=run_eval)


def run_eval(args) -> int:
    from prefillshare.app.rendering import RenderError
    from prefillshare.app.training.evaluate import ModelSet, evaluate, evaluate_paths, to_markdown, write_results

    set_threads(args)
    try:
        if args.base:
            result = evaluate_paths(args.data, args.base, args.decoder, args.full_ft, args.layer_split,
                                    batch_size=args.batch_size, limit=args.limit, agent_field=args.agent_field)
        elif args.decoder or args.full_ft or args.layer_split:
            return _fail("--decoder/--full-ft/--layer-split need --base")
        else:
            result = evaluate(args.data, ModelSet.under(args.models), batch_size=args.batch_size, limit=args.limit)
    except (DataError, ManifestError, CheckpointError, RenderError) as e:
        return _fail(str(e))
    out = Path(args.out) if args.out else Path("runs/eval") / Path(args.data).stem
    json_path, md_path = write_results(result, out)
    print(to_markdown(result))
    print(f"wrote {json_path} and {md_path}")
    return 0
