"""The evaluation table: per agent, exact match and answer NLL of five ways to answer.

- ``base``: the prefill module alone, its own prefill (no fine-tuning);
- ``full_ft``: the Full-FT model, its own prefill (the accuracy to match);
- ``prefillshare``: base KV of prompt[:-1] + the cache-conditioned decoder (the served path);
- ``naive_reuse``: base KV + the Full-FT model as decoder (sharing without cache-conditioning);
- ``layer_split``: lower layers shared with the base, upper layers fine-tuned, own prefill.

"prefill saved" is the share of a decoder's private prompt prefill (token x layer work) that it
skips because the base's prefill is reused: (n-1)/n of the prompt for base-KV methods, S/L of
the layers for layer-split, 0 for private prefill.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from prefillshare.app.models import checkpoint
from prefillshare.app.models.compat import check, check_configs
from prefillshare.app.models.identity import CheckpointError, load_config_dict, prefill_module_id
from prefillshare.app.models.manifest import read_manifest
from prefillshare.app.prompt_split import split_prompt
from prefillshare.app.reference import SharedKV, batched_greedy_from_kv
from prefillshare.app.rendering import Renderer
from prefillshare.app.training import batches, tasks
from prefillshare.app.training.tokenizer import load_tokenizer

METHODS = ("base", "full_ft", "prefillshare", "naive_reuse", "layer_split")


@dataclass(frozen=True)
class Cell:
    exact_match: float   # percent
    answer_nll: float    # mean NLL per answer token (incl. </s>)
    prefill_saved: float  # share of the decoder's prompt prefill work skipped
    n: int


@dataclass(frozen=True)
class ModelSet:
    """Where the checkpoints of one evaluation live (defaults: the shipped layout)."""

    base: Path
    decoders: Path
    fullft: Path
    layersplit: Path

    @classmethod
    def under(cls, root: str | Path) -> ModelSet:
        root = Path(root)
        return cls(root / "base", root / "decoders", root / "baselines" / "fullft", root / "baselines" / "layersplit")


def _agent_models(models: ModelSet, agent: str) -> dict[str, Path]:
    return {"prefillshare": models.decoders / agent, "full_ft": models.fullft / agent,
            "layer_split": models.layersplit / agent}


def validate(models: ModelSet, agents: Sequence[str]) -> None:
    """Fail before computing anything: each checkpoint present, with manifest, built on this base."""
    if not (models.base / "config.json").is_file():
        raise CheckpointError(f"{models.base}: no base checkpoint (config.json missing)")
    for agent in agents:
        for method, path in _agent_models(models, agent).items():
            if not path.is_dir():
                raise CheckpointError(f"{path}: no {method} decoder for agent {agent!r}")
            manifest = read_manifest(path)
            if manifest.agent != agent:
                raise CheckpointError(f"{path}: manifest says agent {manifest.agent!r}, expected {agent!r}")
        verdict = check(models.base, models.decoders / agent)
        if not verdict.shared:
            raise CheckpointError(f"{models.decoders / agent}: cannot consume the base's KV: " + "; ".join(verdict.reasons))


def _answer_text(tok, ids: Sequence[int], eos: int) -> str | None:
    """The generated answer, or None when the model never ended it with </s>."""
    if eos not in ids:
        return None
    return tasks.parse_response(tok.decode(list(ids[: list(ids).index(eos)])))


@torch.no_grad()
def _score_agent(tok, base, runs: dict, enc: Sequence[batches.Encoded], batch_size: int) -> dict[str, tuple[float, float]]:
    """{method: (exact match %, mean answer NLL per token)} over ``enc``.

    Per batch each prefill model's prefix KV is computed once and shared by every method that
    reads it (the base's KV serves base, PrefillShare and naive reuse), for NLL and generation.
    """
    eos, pad = tok.eos_token_id, batches.pad_id_of(tok)
    totals = {m: [0, 0.0, 0] for m in runs}  # correct, nll sum, answer tokens
    for i in range(0, len(enc), batch_size):
        chunk = enc[i: i + batch_size]
        batch = batches.collate(chunk, pad).to(_device(base))
        own = [split_prompt(e.prompt)[1] for e in chunk]
        want = [tasks.parse_response(tok.decode(e.response[:-1])) for e in chunk]
        max_new = max(len(e.response) for e in chunk) + 2
        kvs: dict[int, batches.PrefixKV] = {}
        for method, (decoder, shared, _) in runs.items():
            prefill_model = base if shared else decoder
            if id(prefill_model) not in kvs:
                kvs[id(prefill_model)] = batches.prefix_kv(prefill_model, batch.prefix_ids, batch.prefix_mask)
            kv = kvs[id(prefill_model)]
            nll, count = batches.shared_nll_batch(decoder, kv, batch)
            shared_kv = SharedKV(DynamicCache(ddp_cache_data=kv.layers), kv.mask, kv.lengths)
            outs = batched_greedy_from_kv(decoder, shared_kv, own, max_new, eos, pad)
            t = totals[method]
            t[0] += sum(int(_answer_text(tok, o, eos) == w) for o, w in zip(outs, want))
            t[1] += float(nll.sum())
            t[2] += int(count.sum())
    return {m: (100.0 * c / len(enc), s / max(1, n)) for m, (c, s, n) in totals.items()}


def _device(model) -> torch.device:
    return next(model.parameters()).device


def evaluate(data_path: str | Path, models: ModelSet, batch_size: int = 64, limit: int | None = None) -> dict:
    """Score every method on every agent of ``data_path``; returns the table as a dict."""
    known = [p.name for p in sorted(models.decoders.iterdir()) if p.is_dir()] if models.decoders.is_dir() else []
    examples = tasks.read_jsonl(data_path, known_agents=known)
    agents = list(tasks.iter_agents(examples))
    validate(models, agents)
    tok = load_tokenizer(models.base)
    base = checkpoint.load_model(models.base)
    n_layers = base.config.num_hidden_layers
    table: dict[str, dict[str, Cell]] = {}
    for agent in agents:
        data = [e for e in examples if e.agent == agent][:limit]
        paths = _agent_models(models, agent)
        enc = batches.encode(tok, data, Renderer.for_decoder(paths["prefillshare"]))  # as trained and served
        saved_share = sum(len(split_prompt(e.prompt)[0]) / len(e.prompt) for e in enc) / len(enc)
        fullft = checkpoint.load_decoder(paths["full_ft"], models.base)
        cc = checkpoint.load_decoder(paths["prefillshare"], models.base)
        ls = checkpoint.load_decoder(paths["layer_split"], models.base)
        shared_layers = read_manifest(paths["layer_split"]).training.get("shared_layers", 0)
        runs = {
            "base": (base, False, 0.0),
            "full_ft": (fullft, False, 0.0),
            "prefillshare": (cc, True, saved_share),
            "naive_reuse": (fullft, True, saved_share),
            "layer_split": (ls, False, shared_layers / n_layers),
        }
        scores = _score_agent(tok, base, runs, enc, batch_size)
        table[agent] = {m: Cell(round(scores[m][0], 2), round(scores[m][1], 4), round(runs[m][2], 4), len(enc))
                        for m in runs}
    return {"data": str(data_path), "methods": list(METHODS),
            "agents": {a: {m: asdict(c) for m, c in row.items()} for a, row in table.items()}}


def _eval_device() -> tuple[torch.device, torch.dtype]:
    """A GPU in bf16 when there is one, else the CPU in float32 (bf16 is emulated on many CPUs)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.device("cpu"), torch.float32


def evaluate_paths(data_path: str | Path, base_dir: str | Path, decoder: str | Path | None = None,
                   full_ft: str | Path | None = None, layer_split: str | Path | None = None,
                   batch_size: int = 64, limit: int | None = None, agent_field: str = "agent") -> dict:
    """The table for ONE agent's checkpoints given by path, any subset of methods, data in any format.

    The agent and the prompt rendering come from the first given checkpoint's manifest; every
    checkpoint is validated (manifest, built on this base; the decoder must be able to consume
    the base's KV) before a model loads.
    """
    from prefillshare.app.rendering import Renderer
    from prefillshare.app.training.data import read_records, render_records

    base_dir = Path(base_dir)
    if not (base_dir / "config.json").is_file():
        raise CheckpointError(f"{base_dir}: no config.json (not a base checkpoint)")
    given = {m: Path(p) for m, p in (("prefillshare", decoder), ("full_ft", full_ft), ("layer_split", layer_split))
             if p is not None}
    if not given:
        raise CheckpointError("nothing to evaluate: give --decoder, --full-ft and/or --layer-split")
    manifests = {m: read_manifest(p) for m, p in given.items()}
    agents = {m.agent for m in manifests.values()}
    if len(agents) > 1:
        raise CheckpointError(f"the checkpoints are for different agents: {sorted(agents)}")
    agent = agents.pop()
    if "prefillshare" in given:
        verdict = check(base_dir, given["prefillshare"])
        if not verdict.shared:
            raise CheckpointError(f"{given['prefillshare']}: cannot consume the base's KV: " + "; ".join(verdict.reasons))
    base_id = None
    for m, path in given.items():
        if manifests[m].adapter is None and m != "prefillshare":
            base_id = base_id or prefill_module_id(base_dir)
            if manifests[m].prefill_module_id != base_id:
                raise CheckpointError(f"{path}: trained on prefill module {manifests[m].prefill_module_id}, not {base_id}")
            if m == "full_ft":
                problems = check_configs(load_config_dict(base_dir), load_config_dict(path))
                if problems:
                    raise CheckpointError(f"{path}: naive reuse cannot read the base's KV: " + "; ".join(problems))
    first = next(iter(given.values()))
    renderer = Renderer.for_decoder(first, manifests[next(iter(given))])
    tok = load_tokenizer(base_dir)
    records = read_records(data_path, agent, agent_field)  # lines naming another agent are skipped
    enc = render_records(records[:limit], tok, renderer)
    device, dtype = _eval_device()
    base = checkpoint.load_model(base_dir, dtype).to(device)
    saved_share = sum(len(split_prompt(e.prompt)[0]) / len(e.prompt) for e in enc) / len(enc)
    runs: dict[str, tuple] = {"base": (base, False, 0.0)}
    if "full_ft" in given:
        fullft = checkpoint.load_decoder(given["full_ft"], base_dir, dtype).to(device)
        runs["full_ft"] = (fullft, False, 0.0)
    if "prefillshare" in given:
        runs["prefillshare"] = (checkpoint.load_decoder(given["prefillshare"], base_dir, dtype).to(device), True,
                                saved_share)
    if "full_ft" in given:
        runs["naive_reuse"] = (runs["full_ft"][0], True, saved_share)
    if "layer_split" in given:
        shared = manifests["layer_split"].training.get("shared_layers", 0)
        runs["layer_split"] = (checkpoint.load_decoder(given["layer_split"], base_dir, dtype).to(device), False,
                               shared / base.config.num_hidden_layers)
    scores = _score_agent(tok, base, runs, enc, batch_size)
    row = {m: asdict(Cell(round(scores[m][0], 2), round(scores[m][1], 4), round(runs[m][2], 4), len(enc)))
           for m in runs}
    return {"data": str(data_path), "methods": [m for m in METHODS if m in runs], "agents": {agent: row},
            "prompt_format": renderer.format}


def merge_results(results: Sequence[dict]) -> dict:
    """One table from per-agent results with the same methods."""
    out = {"data": results[0]["data"], "methods": results[0]["methods"], "agents": {}}
    for r in results:
        out["agents"].update(r["agents"])
    return out


def to_markdown(result: dict) -> str:
    """Two tables: exact match / NLL per agent and method, and prefill work saved per method."""
    methods = result["methods"]
    lines = ["| agent | n | " + " | ".join(f"{m} EM% / NLL" for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    for agent, row in result["agents"].items():
        n = next(iter(row.values()))["n"]
        cells = [f"{row[m]['exact_match']:.1f} / {row[m]['answer_nll']:.3f}" for m in methods]
        lines.append(f"| {agent} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "| method | prefill saved per decoder |", "|---|---|"]
    for m in methods:
        vals = [row[m]["prefill_saved"] for row in result["agents"].values()]
        lines.append(f"| {m} | {100 * sum(vals) / len(vals):.1f}% |")
    if result.get("fanout"):  # the chat recipe: what the base computes for one fan-out, per layout
        lines += ["", "| layout | agents | base prompt tokens per fan-out | one agent's prompt | ratio |",
                  "|---|---|---|---|---|"]
        for layout, f in result["fanout"].items():
            lines.append(f"| {layout} | {f['agents']} | {f['base_tokens_per_fanout']:.0f} | "
                         f"{f['tokens_per_prompt']:.0f} | {f['ratio_to_one_prompt']:.2f}x |")
    return "\n".join(lines) + "\n"


def write_results(result: dict, out_prefix: str | Path) -> tuple[Path, Path]:
    """``<prefix>.json`` and ``<prefix>.md``, each written whole (temp file + rename)."""
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = (out_prefix.with_suffix(".json"), out_prefix.with_suffix(".md"))
    for path, text in zip(paths, (json.dumps(result, indent=2) + "\n", to_markdown(result))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths
