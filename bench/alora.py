"""Activated LoRA adapters made with PEFT's own aLoRA support on the shipped base, as a user brings them.

Each adapter learns, with PEFT's ``LoraConfig(alora_invocation_tokens=...)``, to answer a fixed
phrase after its invocation string, over the shipped chat records' text; PEFT writes it with
``save_pretrained`` and tests/test_alora.py and bench/in_engine_probe.py serve that directory unmodified. Training is a few dozen steps of
a 4-layer model (seconds); the weights move far enough that the adapter's tokens differ from the
base's and from the same weights run as ordinary LoRA.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

CKPT = Path(__file__).resolve().parents[1] / "checkpoints"
# name -> (invocation string, the phrase it learns to answer)
ADAPTERS = {
    "check": ("<|check|>", " verdict: yes"),
    "route": ("<|route|>", " hub: north"),
    "judge": ("<|judge|>", " score: high"),
    "fix": ("<|fix|>", " patch: none"),
}
RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def texts(n: int, seed: int = 0, ckpt: Path = CKPT) -> list[str]:
    """User-turn texts of the shipped chat records (the base has seen such text)."""
    records = [json.loads(line) for line in (ckpt / "chat" / "data" / "test.jsonl").read_text().splitlines() if line]
    rng = random.Random(seed)
    return [rng.choice(records)["messages"][1]["content"] for _ in range(n)]


def invocation_ids(tokenizer, name: str) -> list[int]:
    return tokenizer.encode(ADAPTERS[name][0], add_special_tokens=False)


def train(out: Path, names=tuple(ADAPTERS), steps: int = 40, ckpt: Path = CKPT) -> dict[str, Path]:
    """PEFT aLoRA adapters of the shipped base, one directory each under ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from prefillshare.app.training.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt / "base")
    paths = {}
    for k, name in enumerate(names):
        torch.manual_seed(k)
        base = AutoModelForCausalLM.from_pretrained(ckpt / "base", dtype=torch.float32)
        cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, task_type="CAUSAL_LM",
                         alora_invocation_tokens=invocation_ids(tok, name))
        model = get_peft_model(base, cfg)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
        answer = tok.encode(ADAPTERS[name][1], add_special_tokens=False)
        for step in range(steps):
            batch = [tok.encode(t, add_special_tokens=False)[-96:] for t in texts(4, 1000 * k + step, ckpt)]
            rows = [[tok.bos_token_id, *b, *invocation_ids(tok, name), *answer, tok.eos_token_id] for b in batch]
            width = max(map(len, rows))
            ids = torch.tensor([[tok.pad_token_id or 0] * (width - len(r)) + r for r in rows])  # left-padded
            labels = torch.full_like(ids, -100)
            labels[:, -len(answer) - 1:] = ids[:, -len(answer) - 1:]
            mask = (torch.arange(width) >= torch.tensor([[width - len(r)] for r in rows])).long()
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        paths[name] = out / name
        model.save_pretrained(paths[name])
    return paths


def as_plain_lora(src: Path, dst: Path) -> Path:
    """The same weights with the invocation left out of adapter_config.json: ordinary LoRA."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = None
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def peft_greedy(path: Path, prompts: list[list[int]], max_new: int, ckpt: Path = CKPT,
                device: str = "cpu") -> list[list[int]]:
    """PEFT's own generate() with the adapter at ``path`` (float32, greedy, on ``device``): the reference."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ckpt / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, path).eval().to(device)
    eos = base.config.eos_token_id
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
            out.append(gen[0, len(p):].tolist())
    return out
