"""One trainer for decode modules: cache-conditioned fine-tuning and its two baselines.

- ``cache_conditioned`` (PrefillShare): the frozen base computes the KV of prompt[:-1] without
  gradients; the decoder (initialised from the base) runs prompt[-1] + response on that KV
  with teacher forcing; loss on the response only; only decoder weights change.
- ``full_ft``: ordinary fine-tuning, the model prefills its own prompt.
- ``layer_split``: the lower ``shared_layers`` layers (and the embeddings) stay the base's and
  frozen, the upper layers are fine-tuned, the model prefills its own prompt.

All three see the same data order, steps and learning rate for a given seed. Full-parameter or
LoRA (peft, merged before export so vLLM loads a plain checkpoint).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from app.models import checkpoint
from app.models.identity import prefill_module_id, tokenizer_hash
from app.models.manifest import METHODS, DecodeManifest
from app.training import batches, tasks
from app.training.tokenizer import load_tokenizer

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TrainConfig:
    method: str = "cache_conditioned"
    steps: int = 300
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    seed: int = 0
    lora: bool = False
    lora_rank: int = 8
    shared_layers: int = 2      # layer_split only
    save_every: int = 100       # resumable state every N steps (0: never)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to 10%."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _prepare_decoder(base_dir: Path, cfg: TrainConfig, device):
    decoder = checkpoint.load_model(base_dir).to(device)
    decoder.train()
    n_layers = decoder.config.num_hidden_layers
    if cfg.method == "layer_split" and not 0 < cfg.shared_layers < n_layers:
        raise ValueError(f"shared_layers must be in 1..{n_layers - 1}, got {cfg.shared_layers}")
    upper = range(cfg.shared_layers, n_layers) if cfg.method == "layer_split" else range(n_layers)
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, lora_dropout=0.0,
                          target_modules=list(LORA_TARGETS), layers_to_transform=list(upper))
        decoder = get_peft_model(decoder, lora)
    elif cfg.method == "layer_split":
        trainable = tuple(f"model.layers.{i}." for i in upper) + ("model.norm.",)
        for name, p in decoder.named_parameters():
            p.requires_grad_(name.startswith(trainable))
    return decoder


def _state_path(state_dir: Path) -> Path:
    return state_dir / "trainer_state.pt"


def train_decoder(
    base_dir: str | Path,
    examples: list[tasks.Example],
    agent: str,
    out_dir: str | Path,
    cfg: TrainConfig,
    state_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
) -> Path | None:
    """Train one decode module for ``agent`` on top of the prefill module at ``base_dir``.

    ``stop_after``: leave after that many steps in this call, with resumable state saved in
    ``state_dir`` and nothing exported (returns None), as an interrupted run would.
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    data = [e for e in examples if e.agent == agent]
    if not data:
        raise ValueError(f"no training examples for agent {agent!r}")
    device = _device()
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(base_dir)
    enc = batches.encode(tok, data)
    base = checkpoint.load_model(base_dir).to(device)
    base.requires_grad_(False)
    decoder = _prepare_decoder(base_dir, cfg, device)
    params = [p for p in decoder.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    rng = random.Random(cfg.seed)
    step = 0
    state_dir = Path(state_dir) if state_dir else None
    if resume:
        if state_dir is None or not _state_path(state_dir).is_file():
            raise FileNotFoundError(f"--resume: no trainer state in {state_dir}")
        st = torch.load(_state_path(state_dir), weights_only=False)
        if st["config"] != asdict(cfg) or st["agent"] != agent:
            raise ValueError(f"{state_dir}: saved state is for another run ({st['agent']}, {st['config']})")
        decoder.load_state_dict(st["decoder"])
        opt.load_state_dict(st["optimizer"])
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        step = st["step"]

    order: list[int] = []
    if resume:
        order = st["order"]
    bar = tqdm(total=cfg.steps, initial=step, desc=f"{cfg.method}:{agent}", disable=not progress,
               dynamic_ncols=True, mininterval=1.0)
    t0, tokens, steps_this_call = time.perf_counter(), 0, 0
    loss = torch.tensor(float("nan"))
    while step < cfg.steps:
        if len(order) < cfg.batch_size:
            perm = list(range(len(enc)))
            rng.shuffle(perm)
            order += perm
        batch = [enc[i] for i in order[: cfg.batch_size]]
        order = order[cfg.batch_size:]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        if cfg.method == "cache_conditioned":
            nll, count = batches.shared_nll(base, decoder, batch, tok.pad_token_id)
        else:
            nll, count = batches.private_nll(decoder, batch, tok.pad_token_id)
        loss = nll.sum() / count.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        steps_this_call += 1
        tokens += sum(len(e.prompt) + len(e.response) for e in batch)
        bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}", refresh=False)
        bar.update(1)
        interrupted = stop_after is not None and steps_this_call >= stop_after and step < cfg.steps
        if state_dir and ((cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps) or interrupted):
            state_dir.mkdir(parents=True, exist_ok=True)
            tmp = _state_path(state_dir).with_suffix(".tmp")
            torch.save({"config": asdict(cfg), "agent": agent, "step": step, "decoder": decoder.state_dict(),
                        "optimizer": opt.state_dict(), "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                        "order": order}, tmp)
            tmp.replace(_state_path(state_dir))
        if interrupted:
            bar.close()
            return None
    bar.close()

    if cfg.lora:
        decoder = decoder.merge_and_unload()
    decoder.eval()
    training = {"method": cfg.method, "steps": cfg.steps, "lr": cfg.lr, "batch_size": cfg.batch_size,
                "seed": cfg.seed, "lora": cfg.lora, "final_loss": round(float(loss.item()), 5),
                "train_examples": len(enc)}
    if cfg.lora:
        training["lora_rank"] = cfg.lora_rank
    manifest_kwargs = dict(agent=agent, prefill_module_id=prefill_module_id(base_dir), tokenizer_hash=tokenizer_hash(base_dir))
    if cfg.method == "layer_split":
        training.update(shared_layers=cfg.shared_layers, weights="upper_layers")
        path = checkpoint.save_upper_layers(decoder, cfg.shared_layers, out_dir, base_dir,
                                            DecodeManifest(training=training, **manifest_kwargs))
    else:
        path = checkpoint.save_model(decoder, out_dir, base_dir, DecodeManifest(training=training, **manifest_kwargs))
    if state_dir and _state_path(state_dir).is_file():
        _state_path(state_dir).unlink()
    return path
