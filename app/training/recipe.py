"""The full recipe that regenerates every shipped model: ``prefillshare train --recipe all``.

tokenizer -> data -> base (pretrained until the retrieval gate passes) -> per agent: the
cache-conditioned decoder, the Full-FT baseline and the layer-split baseline (same data, steps,
learning rate and seed) -> the eval table on the held-out split.
"""
from __future__ import annotations

import multiprocessing
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

from prefillshare.app.models.manifest import PromptFormat, read_manifest
from prefillshare.app.rendering import Renderer
from prefillshare.app.training import tasks
from prefillshare.app.training.pretrain import PretrainConfig, pretrain_base
from prefillshare.app.training.trainer import TrainConfig, has_checkpoint, train_decoder


@dataclass(frozen=True)
class SuiteSplit:
    """The generated suite both recipes train and evaluate on: contexts, agents, a held-out split."""

    contexts: int = 3000
    test_fraction: float = 0.07
    seed: int = 0
    agents: tuple[str, ...] = tuple(tasks.AGENTS)

    def examples(self) -> tuple[list[tasks.Example], list[tasks.Example]]:
        """(train, test); test contexts are never seen in training."""
        return tasks.split_examples(tasks.make_examples(self.contexts, self.seed, self.agents),
                                    self.test_fraction, self.seed)


@dataclass(frozen=True)
class Recipe(SuiteSplit):
    pretrain: PretrainConfig = PretrainConfig()
    decoder: TrainConfig = TrainConfig(steps=120, batch_size=32, lr=2e-3, warmup=12)
    shared_layers: int = 2
    baselines: dict = field(default_factory=lambda: {"fullft": "full_ft", "layersplit": "layer_split"})


DEFAULT_RECIPE = Recipe()
QUICK_RECIPE = Recipe(contexts=200, pretrain=PretrainConfig(steps=20, max_steps=20, eval_every=20, gate=0.0,
                                                            gate_queries=64),
                      decoder=TrainConfig(steps=5, batch_size=8, lr=1e-3, warmup=2))


# Each agent has its own system prompt, as agents are defined in agent frameworks. Both recipes
# train shared-first: the record is the shared part and the agent's system prompt and question
# follow it (the suite: ``record\nsystem\nquestion``; the chat suite: chat_record).
AGENT_SYSTEMS = {
    "lookup": "You are the lookup agent of the order desk. Answer with the value the question asks for.",
    "tool_call": "You are the shipping agent of the order desk. Answer with the shipping tool call.",
    "reschedule": "You are the scheduling agent of the order desk. Answer with the new delivery day.",
    "route": "You are the routing agent of the order desk. Answer with the hub for the order's city.",
}


def suite_renderer(agent: str) -> Renderer:
    """How the suite's decoders render an agent request: the record, then the agent's system prompt
    and question (shared-first), with no chat template."""
    return Renderer(PromptFormat("suite", system=AGENT_SYSTEMS[agent], layout="shared_first"))


def _done(path: Path) -> bool:
    try:
        read_manifest(path)
        return True
    except Exception:  # noqa: BLE001 - any unreadable manifest means the step is not done
        return False


def _train_one(base_dir, train, agent, out, cfg, state, resume, progress, threads) -> str:
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    train_decoder(base_dir, train, agent, out, cfg, state_dir=state, resume=resume, progress=progress,
                  renderer=suite_renderer(agent))
    loss = read_manifest(out).training.get("final_loss")
    return f"{cfg.method}:{agent} -> {out} ({time.perf_counter() - t0:.0f}s, final loss {loss})"


def run_recipe(which: str, models: Path, work: Path, quick: bool = False, resume: bool = False,
               progress: bool = True, recipe: Recipe | None = None, jobs: int = 2, threads: int = 1) -> None:
    """``which``: "all", "base" or "chat". Outputs under ``models`` (checkpoints/), scratch under ``work``."""
    if which == "chat":
        return run_chat_recipe(models, work, quick=quick, resume=resume, jobs=jobs, threads=threads)
    from prefillshare.app.training.evaluate import ModelSet, evaluate, to_markdown, write_results
    from prefillshare.app.training.tokenizer import train_tokenizer

    r = recipe or (QUICK_RECIPE if quick else DEFAULT_RECIPE)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[recipe {time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    tok_dir, base_dir = models / "tokenizer", models / "base"
    if not (resume and (tok_dir / "tokenizer.json").is_file()):
        train_tokenizer(tok_dir, seed=r.seed)
        log(f"tokenizer -> {tok_dir}")
    train, test = r.examples()
    tasks.write_jsonl(work / "data" / "train.jsonl", train)
    tasks.write_jsonl(work / "data" / "test.jsonl", test)
    tasks.write_jsonl(models / "data" / "test.jsonl", test)
    log(f"data: {len(train)} train / {len(test)} test examples -> {work / 'data'}")
    if not (resume and (base_dir / "config.json").is_file()):
        acc = pretrain_base(tok_dir, base_dir, r.pretrain, progress=progress)
        log(f"base -> {base_dir} (retrieval gate {acc:.3f} >= {r.pretrain.gate})")
    if which == "base":
        return
    targets = [("cache_conditioned", models / "decoders")] + [
        (method, models / "baselines" / sub) for sub, method in r.baselines.items()]
    jobs_args = []
    for method, root in targets:  # every decoder first, then the baselines
        for agent in r.agents:
            out = root / agent
            if resume and _done(out):
                log(f"{method}:{agent} exists, skipped")
                continue
            cfg = replace(r.decoder, method=method, seed=r.seed, shared_layers=r.shared_layers)
            state = work / "state" / f"{method}-{agent}"
            jobs_args.append((base_dir, train, agent, out, cfg, state,
                              resume and has_checkpoint(state), progress and jobs == 1, threads))
    if jobs == 1:
        for a in jobs_args:
            log(_train_one(*a))
    else:  # independent runs in parallel processes, one torch thread each
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            for fut in as_completed([pool.submit(_train_one, *a) for a in jobs_args]):
                log(fut.result())
    result = evaluate(models / "data" / "test.jsonl", ModelSet.under(models))
    json_path, md_path = write_results(result, models / "eval" / "results")
    print(to_markdown(result))
    log(f"eval -> {json_path}, {md_path}")
    shutil.rmtree(work / "state", ignore_errors=True)


# --- the chat-format suite: the same records as conversations, LoRA decoders through the CLI ---
# Role headers before each turn and no generation prompt: shared-first, the last prompt token
# is the question's last word (the field name), the token the decoder runs itself; answers are
# " value" then eos, the way values are written everywhere in the suite.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ ' ' + m['content'] + eos_token }}"
    "{%- else -%}{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}{{ m['role'] + ':\\n' + m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
# (method, layout, where the adapters go under models/chat): the shipped decoders, their Full-FT
# baseline, and the same decoders trained system-first (what the layout costs or gains)
CHAT_RUNS = (("cache_conditioned", "shared-first", "adapters"), ("full_ft", "shared-first", "baselines/fullft"),
             ("cache_conditioned", "system-first", "baselines/system_first"))


@dataclass(frozen=True)
class ChatRecipe(SuiteSplit):
    steps: int = 120
    batch_size: int = 32
    lr: float = 5e-3
    lora_rank: int = 8
    # route (retrieve the city, then classify it) needs more steps than a rank-8 adapter's other
    # tasks: 45.2% EM at 120 steps, 100% at 600 (docs/training.md)
    agent_steps: dict = field(default_factory=lambda: {"route": 600})

    def steps_for(self, agent: str) -> int:
        return self.agent_steps.get(agent, self.steps)


def chat_record(e: tasks.Example) -> dict:
    """A suite example as an agent framework sends it: the agent's system prompt and its question
    (its own text), the record as the user turn (what every agent shares), the answer."""
    return {"agent": e.agent, "messages": [{"role": "system", "content": f"{AGENT_SYSTEMS[e.agent]}\n{e.instruction}"},
                                           {"role": "user", "content": e.context},
                                           {"role": "assistant", "content": e.answer}]}


def _write_chat(path: Path, examples) -> None:
    import json
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(chat_record(e)) + "\n" for e in examples), encoding="utf-8")
    os.replace(tmp, path)


def _cli(argv: list[str]) -> str:
    """One `prefillshare ...` run in a worker process (the same CLI a user runs)."""
    from prefillshare.app.cli import main

    t0 = time.perf_counter()
    rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"prefillshare {' '.join(argv)} exited {rc}")
    opt = dict(zip(argv, argv[1:]))
    return (f"{opt.get('--method')}:{opt.get('--agent')} -> {opt.get('--adapter-out')} "
            f"({time.perf_counter() - t0:.0f}s)")


def run_chat_recipe(models: Path, work: Path, quick: bool = False, resume: bool = False, jobs: int = 2,
                    threads: int = 1, recipe: ChatRecipe | None = None) -> None:
    """On the shipped base: chat data, per agent a LoRA cache-conditioned decoder and a LoRA Full-FT
    baseline (adapters under ``models/chat``), then the table (base, Full-FT, PrefillShare, naive reuse)."""
    from prefillshare.app.training.evaluate import evaluate_paths, merge_results, to_markdown, write_results

    r = recipe or (ChatRecipe(contexts=120, steps=4, batch_size=8, agent_steps={}) if quick else ChatRecipe())
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[chat recipe {time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    base_dir, root = models / "base", models / "chat"
    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(f"{base_dir}: no base; run `prefillshare train --recipe base` first")
    train, test = r.examples()
    data = work / "chat"
    _write_chat(data / "train.jsonl", train)
    _write_chat(root / "data" / "test.jsonl", test)
    template = data / "template.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    log(f"data: {len(train)} train / {len(test)} test conversations -> {data}")
    argvs = []
    for method, layout, sub in CHAT_RUNS:
        for agent in r.agents:
            adapter = root / sub / agent
            if resume and _done(adapter):
                log(f"{method}:{agent} ({layout}) exists, skipped")
                continue
            argvs.append(["train", "--base", str(base_dir), "--data", str(data / "train.jsonl"), "--agent", agent,
                          "--chat-template", str(template), "--system", AGENT_SYSTEMS[agent], "--layout", layout,
                          "--lora", "--lora-rank", str(r.lora_rank),
                          "--method", method, "--steps", str(r.steps_for(agent)), "--batch-size", str(r.batch_size),
                          "--lr", str(r.lr), "--warmup", str(max(1, r.steps_for(agent) // 10)), "--threads", str(threads),
                          "--no-progress", "--out", str(data / "merged" / sub / agent),
                          "--adapter-out", str(adapter)])
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx) as pool:
        for fut in as_completed([pool.submit(_cli, a) for a in argvs]):
            log(fut.result())
    test_path = root / "data" / "test.jsonl"
    results = [evaluate_paths(test_path, base_dir, decoder=root / "adapters" / agent,
                              full_ft=root / "baselines" / "fullft" / agent) for agent in r.agents]
    result = merge_results(results)
    for agent in r.agents:  # the same decoders trained system-first, as one more column
        row = evaluate_paths(test_path, base_dir, decoder=root / "baselines" / "system_first" / agent)
        result["agents"][agent]["system_first"] = row["agents"][agent]["prefillshare"]
    result["methods"] = [*result["methods"], "system_first"]
    result["fanout"] = {layout: fanout_prefill_tokens(test_path, base_dir, root / sub, r.agents)
                        for method, layout, sub in CHAT_RUNS if method == "cache_conditioned"}
    json_path, md_path = write_results(result, root / "eval" / "results")
    print(to_markdown(result))
    log(f"eval -> {json_path}, {md_path}")


def fanout_prefill_tokens(data_path: Path, base_dir: Path, decoders: Path, agents) -> dict:
    """Prompt tokens the base computes for one fan-out of every agent over one record (the shared
    prefix once, each prompt's own rest), against one agent's prompt, in the decoders' layout."""
    from prefillshare.app.rendering import Renderer
    from prefillshare.app.sharing import fanout_cost
    from prefillshare.app.training.data import read_records
    from prefillshare.app.training.tokenizer import load_tokenizer

    tok = load_tokenizer(base_dir)
    renderers = {a: Renderer.for_decoder(decoders / a) for a in agents}
    by_record: dict[str, list[list[int]]] = {}
    for a in agents:
        for rec in read_records(data_path, a):
            *prompt, _ = rec.messages
            by_record.setdefault(prompt[-1][1], []).append(renderers[a].chat_ids(tok, prompt))
    costs = [fanout_cost(p) for p in by_record.values() if len(p) == len(agents)]
    computed = sum(c for c, _ in costs) / len(costs)
    one = sum(o for _, o in costs) / len(costs)
    return {"fanouts": len(costs), "agents": len(agents), "base_tokens_per_fanout": round(computed, 1),
            "tokens_per_prompt": round(one, 1), "ratio_to_one_prompt": round(computed / one, 2)}

