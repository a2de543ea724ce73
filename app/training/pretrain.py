"""Pretraining the base (the prefill module) on the record language, gated on retrieval.

Documents are records followed by dense field queries (``city=oslo`` lines); the loss is plain
next-token prediction over whole documents. Decoders are fine-tuned only from a base that
passes the gate: one-token retrieval accuracy on held-out records.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaForCausalLM

from prefillshare.app.errors import PrefillShareLibraryError
from prefillshare.app.models import checkpoint
from prefillshare.app.models.shapes import llama_config
from prefillshare.app.reference import pad_right
from prefillshare.app.training import tasks
from prefillshare.app.training.tokenizer import load_tokenizer


class GateError(PrefillShareLibraryError, RuntimeError):
    """The base did not reach the retrieval gate; decoders would be trained on a weak base."""


@dataclass(frozen=True)
class PretrainConfig:
    steps: int = 200           # at least this many steps; then stop at the first eval that passes the gate
    max_steps: int = 600       # keep training past ``steps`` until the gate passes, up to here
    batch_size: int = 32
    lr: float = 5e-3
    warmup: int = 50
    seed: int = 0
    gate: float = 0.85          # retrieval accuracy required
    eval_every: int = 100
    gate_queries: int = 400
    answers_only: bool = True   # loss on query answers only: record values are random, their loss is noise


@torch.no_grad()
def retrieval_accuracy(model, tok, num: int, seed: int) -> float:
    """Share of held-out ``field=`` queries whose greedy next token is the record's value."""
    rng = random.Random(seed)
    pairs: list[tuple[str, str]] = []
    while len(pairs) < num:
        pairs.extend(tasks.pretrain_text(rng)[1])
    pairs = pairs[:num]
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, num, 64):
        chunk = pairs[i: i + 64]
        ids, mask = pad_right(tok([p for p, _ in chunk])["input_ids"], tok.pad_token_id, model.device)
        logits = model(input_ids=ids, attention_mask=mask).logits
        pred = logits[torch.arange(len(chunk)), mask.sum(1) - 1].argmax(-1).tolist()
        want = [tok(v, add_special_tokens=False)["input_ids"][0] for _, v in chunk]
        correct += sum(int(p == w) for p, w in zip(pred, want))
    model.train(was_training)
    return correct / num


def pretrain_base(tokenizer_dir: str | Path, out_dir: str | Path, cfg: PretrainConfig = PretrainConfig(),
                  progress: bool = True) -> float:
    """Train a base from scratch, save it to ``out_dir`` if it passes the gate; returns the accuracy."""
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(tokenizer_dir)
    model = LlamaForCausalLM(llama_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    rng = random.Random(cfg.seed)
    acc, step, tokens, t0 = 0.0, 0, 0, time.perf_counter()
    bar = tqdm(total=cfg.steps, desc="pretrain base", disable=not progress, dynamic_ncols=True, mininterval=1.0)
    while True:
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        docs = [tasks.pretrain_text(rng) for _ in range(cfg.batch_size)]
        ids, mask = pad_right(tok([d for d, _ in docs])["input_ids"], tok.pad_token_id, device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        if cfg.answers_only:
            keep = torch.zeros_like(labels, dtype=torch.bool)
            for row, (_, pairs) in enumerate(docs):
                for n in map(len, tok([p for p, _ in pairs])["input_ids"]):
                    keep[row, n - 1] = True  # logits at n-1 predict the answer token at n
            labels = labels.masked_fill(~keep, -100)
        loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int(mask.sum())
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}",
                        tok_s=f"{tokens / (time.perf_counter() - t0):.0f}", refresh=False)
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            acc = retrieval_accuracy(model, tok, cfg.gate_queries, cfg.seed + 10_000)
            bar.write(f"step {step}: loss {loss.item():.3f} retrieval {acc:.3f}")
            if step >= cfg.steps and acc >= cfg.gate:
                break
            if step >= cfg.max_steps:
                bar.close()
                raise GateError(f"base reached retrieval {acc:.3f} < gate {cfg.gate} after {step} steps")
    bar.close()
    model.eval()
    checkpoint.save_model(model, out_dir, tokenizer_dir)
    return acc
