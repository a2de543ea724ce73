"""Decode-module training on the standard stack: a ``transformers.Trainer`` whose loss is the project's.

- ``cache_conditioned`` (PrefillShare): the frozen base computes the KV of prompt[:-1] without
  gradients; the decoder runs prompt[-1] + response[:-1] on that KV with teacher forcing; loss
  on the response tokens only. LoRA decoders keep ONE copy of the weights: the base KV comes
  from the same model with its adapters disabled (PEFT ``disable_adapter()``), bit-identical
  to the base. Full-parameter decoders keep a frozen copy of the base beside them.
- ``full_ft``: ordinary fine-tuning, the model prefills its own prompt (same batches, same loss).
- ``layer_split``: embeddings and the lower ``shared_layers`` stay the base's and frozen, the
  upper layers train, own prefill.

The Trainer brings bf16 (autocast on GPUs), gradient accumulation (the loss is normalised by
the answer tokens of the whole accumulated batch), evaluation during training, ``report_to``,
save/resume and multi-GPU through accelerate. Gradient checkpointing keeps the prefix KV: the
decoder's layers read a read-only prefix cache (``batches.FrozenPrefixLayer``) that a
recomputed layer sees unchanged. Exports: a merged checkpoint (what vLLM loads) and, for LoRA,
the adapter alone (PEFT ``save_pretrained`` + manifest), both published whole and both in the
base's dtype (weights train in float32; config, tokenizer and everything else come from the base).
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from prefillshare.app.models import checkpoint
from prefillshare.app.models.identity import prefill_module_id, tokenizer_hash
from prefillshare.app.models.manifest import METHODS, AdapterSpec, DecodeManifest
from prefillshare.app.prompt_split import HANDOVER, Activation
from prefillshare.app.rendering import Renderer
from prefillshare.app.training import batches

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# defaults for the user's own (pretrained) models; the shipped recipe passes its own
DEFAULT_LR = {"lora": 2e-4, "full": 1e-5}


@dataclass(frozen=True)
class TrainConfig:
    method: str = "cache_conditioned"
    steps: int = 300
    batch_size: int = 32           # per device, per micro-batch
    lr: float | None = None        # None: DEFAULT_LR by LoRA or full
    warmup: int = 20
    weight_decay: float = 0.0
    seed: int = 0
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: float | None = None  # None: 2 x rank
    lora_targets: tuple[str, ...] = LORA_TARGETS
    shared_layers: int = 2         # layer_split only
    save_every: int = 100          # resumable checkpoint every N steps (0: only when interrupted)
    grad_accum: int = 1
    eval_every: int = 0            # evaluate the held-out loss every N steps (0: never)
    precision: str = "auto"        # auto: bf16 autocast on a bf16-capable GPU, else float32
    gradient_checkpointing: bool = False
    max_length: int | None = None  # prompt + response tokens; longer prompts lose context from the left
    report_to: str = "none"        # e.g. "tensorboard"
    logging_steps: int = 10
    # LoRA only: PEFT's Activated LoRA form. Each prompt ends with these tokens; the adapter trains from
    # them on over the base's KV of what precedes them, and is written with alora_invocation_tokens
    invocation: tuple[int, ...] = ()

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("steps, batch_size and grad_accum must be >= 1")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.invocation and (not self.lora or self.method != "cache_conditioned"):
            raise ValueError("invocation (Activated LoRA) needs lora and the cache_conditioned method")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR["lora" if self.lora else "full"]

    @property
    def bf16(self) -> bool:
        if self.precision == "auto":
            return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return self.precision == "bf16"


class EncodedDataset(Dataset):
    def __init__(self, items: Sequence[batches.Encoded]):
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> batches.Encoded:
        return self.items[i]


class Collator:
    """Encoded examples -> the padded batch (left-padded prefix, right-padded own tokens)."""

    def __init__(self, pad_id: int, activation: Activation = HANDOVER):
        self.pad_id, self.activation = pad_id, activation

    def __call__(self, items: Sequence[batches.Encoded]) -> dict[str, torch.Tensor]:
        return batches.collate(items, self.pad_id, self.activation).as_dict()


def enable_checkpointing_with_prefix(model) -> None:
    """Gradient checkpointing that keeps ``past_key_values``: transformers drops the cache inside
    checkpointed layers unless the layer declares it only reads it, which holds for the frozen
    prefix cache (its ``update`` stores nothing, so the backward recompute sees the same KV)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if hasattr(module, "_can_checkpoint_with_cache"):
            module._can_checkpoint_with_cache = True


class CacheConditionedTrainer(Trainer):
    """The Trainer with the project's loss. ``base``: the frozen prefill module for full-parameter
    decoders; None for LoRA decoders (base KV from the same model, adapters disabled) and for the
    private-prefill baselines."""

    loss_is_scaled_for_ga = True  # compute_loss divides by the accumulated batch's answer tokens

    def __init__(self, *args, method: str = "cache_conditioned", base=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.method = method
        self.base = base
        if base is not None:
            base.to(self.args.device).eval().requires_grad_(False)
        # count answer tokens over the accumulated batch (from "shift_labels") and pass them in
        self.model_accepts_loss_kwargs = True

    def base_kv(self, model, batch: batches.Batch) -> batches.PrefixKV:
        if self.base is not None:
            return batches.prefix_kv(self.base, batch.prefix_ids, batch.prefix_mask)
        peft_model = self.accelerator.unwrap_model(model)
        with peft_model.disable_adapter():
            return batches.prefix_kv(peft_model, batch.prefix_ids, batch.prefix_mask)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = batches.Batch.from_dict(inputs)
        if self.method == "cache_conditioned":
            nll, count = batches.shared_nll_batch(model, self.base_kv(model, batch), batch)
        else:
            nll, count = batches.private_nll_batch(model, batch)
        if num_items_in_batch is None:
            loss = nll.sum() / count.sum().clamp(min=1)
        else:
            loss = nll.sum() / torch.as_tensor(num_items_in_batch, device=nll.device).clamp(min=1)
            if self.args.average_tokens_across_devices:
                loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        return (loss, {"nll": nll.detach(), "count": count}) if return_outputs else loss


class _StopAfter(TrainerCallback):
    """Stops (with a checkpoint) after ``n`` optimizer steps in this call, as an interrupted run would."""

    def __init__(self, n: int):
        self.n, self.start, self.stopped = n, None, False

    def on_step_end(self, args, state, control, **kwargs):
        self.start = state.global_step - 1 if self.start is None else self.start
        if state.global_step - self.start >= self.n and state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True
            self.stopped = True
        return control


def _prepare(base_dir: Path, cfg: TrainConfig, dtype=torch.float32):
    """(model to train, frozen base or None)."""
    model = checkpoint.load_model(base_dir, dtype)
    model.train()
    n_layers = model.config.num_hidden_layers
    if cfg.method == "layer_split" and not 0 < cfg.shared_layers < n_layers:
        raise ValueError(f"shared_layers must be in 1..{n_layers - 1}, got {cfg.shared_layers}")
    upper = range(cfg.shared_layers, n_layers) if cfg.method == "layer_split" else range(n_layers)
    base = None
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank, lora_dropout=0.0,
                          target_modules=list(cfg.lora_targets),
                          layers_to_transform=list(upper) if cfg.method == "layer_split" else None)
        model = get_peft_model(model, lora)
    else:
        if cfg.method == "cache_conditioned":
            base = checkpoint.load_model(base_dir, dtype)
        if cfg.method == "layer_split":
            trainable = tuple(f"model.layers.{i}." for i in upper) + ("model.norm.",)
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith(trainable))
    if cfg.gradient_checkpointing:
        enable_checkpointing_with_prefix(model)
    return model, base


def training_arguments(cfg: TrainConfig, state_dir: Path, eval_enabled: bool, progress: bool) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(state_dir),
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        adam_beta2=0.98,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=cfg.warmup,
        seed=cfg.seed,
        data_seed=cfg.seed,
        bf16=cfg.bf16,
        eval_strategy="steps" if eval_enabled else "no",
        eval_steps=cfg.eval_every or None,
        prediction_loss_only=True,
        save_strategy="steps" if cfg.save_every else "no",
        save_steps=cfg.save_every or cfg.steps,
        save_total_limit=1,
        logging_steps=cfg.logging_steps,
        report_to=cfg.report_to,
        remove_unused_columns=False,
        label_names=["labels"],
        disable_tqdm=not progress,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
    )


def has_checkpoint(state_dir: str | Path) -> bool:
    """Is there a resumable trainer checkpoint in ``state_dir``?"""
    return _last_checkpoint(Path(state_dir)) is not None


def _last_checkpoint(state_dir: Path) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(state_dir)) if state_dir.is_dir() else None


def _training_record(cfg: TrainConfig, train_examples: int, final_loss: float, seconds: float) -> dict:
    """The manifest's ``training`` record: how this decoder was trained."""
    training = {"method": cfg.method, "steps": cfg.steps, "lr": cfg.learning_rate, "batch_size": cfg.batch_size,
                "grad_accum": cfg.grad_accum, "seed": cfg.seed, "lora": cfg.lora, "final_loss": round(final_loss, 5),
                "train_examples": train_examples, "precision": "bf16" if cfg.bf16 else "fp32",
                "seconds": round(seconds, 1)}
    if cfg.max_length:
        training["max_length"] = cfg.max_length
    if cfg.lora:
        training.update(lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank,
                        lora_targets=list(cfg.lora_targets))
    return training


def train_decoder(
    base_dir: str | Path,
    examples: Sequence,
    agent: str,
    out_dir: str | Path,
    cfg: TrainConfig,
    state_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    renderer: Renderer | None = None,
    eval_examples: Sequence | None = None,
    adapter_out: str | Path | None = None,
    tokenizer=None,
) -> Path | None:
    """Train one decode module for ``agent`` on the prefill module at ``base_dir``; returns the export.

    ``examples``: :class:`batches.Encoded` (already rendered) or suite ``tasks.Example`` (rendered
    the suite way); only ``agent``'s are used. ``stop_after``: leave after that many steps with
    a resumable checkpoint in ``state_dir`` and nothing exported (returns None). With LoRA the
    adapter alone is also exported to ``adapter_out`` when given.
    """
    from prefillshare.app.training.tokenizer import load_tokenizer

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    renderer = renderer or Renderer()
    tok = tokenizer or load_tokenizer(base_dir)
    data = _encoded([e for e in examples if e.agent == agent], tok, renderer)
    if not data:
        raise ValueError(f"no training examples for agent {agent!r}")
    evals = _encoded([e for e in (eval_examples or []) if e.agent == agent], tok, renderer)
    state_dir = Path(state_dir) if state_dir else out_dir.with_name(out_dir.name + ".state")
    if resume and _last_checkpoint(state_dir) is None:
        raise FileNotFoundError(f"--resume: no trainer checkpoint in {state_dir}")
    if not resume and state_dir.is_dir():
        shutil.rmtree(state_dir)  # a fresh run never continues another one's checkpoint
    torch.manual_seed(cfg.seed)
    model, base = _prepare(base_dir, cfg)
    args = training_arguments(cfg, state_dir, bool(evals) and cfg.eval_every > 0, progress)
    stopper = _StopAfter(stop_after) if stop_after else None
    trainer = CacheConditionedTrainer(
        model=model, args=args, method=cfg.method, base=base,
        data_collator=Collator(batches.pad_id_of(tok), Activation(cfg.invocation)),
        train_dataset=EncodedDataset(data), eval_dataset=EncodedDataset(evals) if evals else None,
        callbacks=[stopper] if stopper else None)
    t0 = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=_last_checkpoint(state_dir) if resume else None)
    if stopper is not None and stopper.stopped:
        return None
    seconds = time.perf_counter() - t0
    model = trainer.accelerator.unwrap_model(trainer.model)
    final_loss = next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), result.training_loss)
    training = _training_record(cfg, len(data), float(final_loss), seconds)
    path = _export(model, cfg, training, agent, base_dir, out_dir, adapter_out, renderer)
    shutil.rmtree(state_dir, ignore_errors=True)
    return path


def _export(model, cfg: TrainConfig, training: dict, agent: str, base_dir: Path, out_dir: Path,
            adapter_out: str | Path | None, renderer: Renderer) -> Path:
    """The trained decoder written out: merged or layer-split weights to ``out_dir``, and with LoRA the
    adapter alone to ``adapter_out``; an Activated LoRA adapter only as the adapter (merged, it would
    act on every token), to ``adapter_out`` or else ``out_dir``."""
    base_id, tok_hash = prefill_module_id(base_dir), tokenizer_hash(base_dir)
    dtype = checkpoint.stored_dtype(base_dir)  # trained in float32, stored the way the base is
    extra = renderer.extra_files()
    if cfg.invocation:  # PEFT's Activated LoRA form
        lora_cfg = model.peft_config["default"]
        lora_cfg.alora_invocation_tokens, lora_cfg.task_type = list(cfg.invocation), "CAUSAL_LM"
        training["invocation"] = list(cfg.invocation)
        adapter_out = adapter_out or out_dir
    if cfg.lora and adapter_out is not None:
        adapter = AdapterSpec(base_id, cfg.lora_rank, tuple(cfg.lora_targets), float(cfg.lora_alpha or 2 * cfg.lora_rank))
        checkpoint.save_adapter(model, adapter_out, base_dir,
                                DecodeManifest(agent, base_id, tok_hash, training, prompt=renderer.fmt, adapter=adapter),
                                extra_files=extra, dtype=dtype)
        if cfg.invocation:
            return Path(adapter_out)
    if cfg.lora:
        model = model.merge_and_unload()
    model.eval()
    model.config.use_cache = True  # the Trainer turns it off for training; generation wants it
    if cfg.method == "layer_split":
        training.update(shared_layers=cfg.shared_layers, weights="upper_layers")
    manifest = DecodeManifest(agent, base_id, tok_hash, training, prompt=renderer.fmt)
    if cfg.method == "layer_split":
        return checkpoint.save_upper_layers(model, cfg.shared_layers, out_dir, base_dir, manifest, dtype=dtype)
    return checkpoint.save_model(model, out_dir, base_dir, manifest, extra_files=extra, dtype=dtype)


def _encoded(items: Sequence, tok, renderer: Renderer) -> list[batches.Encoded]:
    if not items or isinstance(items[0], batches.Encoded):
        return list(items)
    return batches.encode(tok, items, renderer)
