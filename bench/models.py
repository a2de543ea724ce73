"""Checkpoint directories the serving benchmark deploys.

Speed does not depend on weight values, so one random-weight Llama of realistic shape
(~90M parameters by default) is written once (bf16 safetensors, cached by shape) and every
model directory links to that one file. Directories differ in a config tag, which changes
their prefill-module identity (prefillshare.app.models.identity), so KV pool keys of different "models"
never collide. The EOS row of the (tied) embedding is zero: its logit is then 0 while the
best random logit is positive, so greedy decoding never stops early and every agent
generates exactly O tokens in every system.

Views per system:
  base/                 the shared prefill module (system a)
  dec-<i>/              decoder i, manifest names base (system a; system c ignores manifests)
  own-<i>/              decoder i for system b: its manifest names its OWN identity, so a
                        prefill module on the same directory is "its own model's prefill engine"
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from prefillshare.app.engine import compute_dtype
from prefillshare.app.plan import kv_bytes_per_token

TAG_KEY = "prefillshare_bench_model"


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 2816
    max_position: int = 8192

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("--hidden/--heads/--kv-heads: hidden must divide by heads, heads by kv heads")

    def params(self, vocab: int) -> int:
        hd = self.hidden // self.heads
        attn = 2 * self.hidden * self.heads * hd + 2 * self.hidden * self.kv_heads * hd
        return self.layers * (attn + 3 * self.hidden * self.intermediate) + vocab * self.hidden

    @property
    def key(self) -> str:
        return f"h{self.hidden}-l{self.layers}-a{self.heads}-k{self.kv_heads}-i{self.intermediate}-p{self.max_position}"


SMALL = ModelShape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, max_position=4096)
# a real small model's shape (its layer count shows per-layer overheads as that model would): Qwen2.5-0.5B's
# hidden size, layers, heads and MLP, as a Llama without Qwen's q/k/v biases, over this project's vocabulary
QWEN25_05B = ModelShape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, max_position=32768)
SHAPES = {"default": ModelShape(), "small": SMALL, "qwen2.5-0.5b": QWEN25_05B}


def silent_token_ids(tok) -> list[int]:
    """EOS, the special tokens and the tokens that are not printable text on their own (lone
    UTF-8 bytes, control characters)."""
    def printable(text: str) -> bool:
        return bool(text) and "\ufffd" not in text and (text.isprintable() or text.isspace())

    ids = {tok.eos_token_id, *tok.all_special_ids}
    ids.update(i for i in range(len(tok)) if not printable(tok.decode([i])))
    return sorted(i for i in ids if i is not None)


def _random_source(root: Path, shape: ModelShape, tokenizer_dir: Path) -> Path:
    """The one weights file (+ config), written once per shape."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    src = root / f"src-{shape.key}-text"
    if (src / "model.safetensors").is_file() and (src / "config.json").is_file():
        return src
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      head_dim=shape.hidden // shape.heads, intermediate_size=shape.intermediate,
                      max_position_embeddings=shape.max_position, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      rms_norm_eps=1e-5, rope_theta=10000.0, dtype="bfloat16")
    cfg.architectures = ["LlamaForCausalLM"]
    gen = torch.Generator().manual_seed(1234)
    hd = shape.hidden // shape.heads

    def rnd(*dims):
        return (torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": rnd(len(tok), shape.hidden), "model.norm.weight": torch.ones(
        shape.hidden, dtype=torch.bfloat16)}
    # Tied embeddings: a zero row gives its token logit 0, below the best of hundreds of random
    # logits, so greedy decoding never picks it. Zeroed: EOS (answers run their O tokens) and every
    # token that is not text on its own (special tokens, lone UTF-8 bytes), which the engines'
    # detokenizer holds back: a random model stuck on one would stream no text at all, leaving
    # TTFT and the streaming path unmeasured.
    state["model.embed_tokens.weight"][silent_token_ids(tok)] = 0
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rnd(shape.heads * hd, shape.hidden),
            p + "self_attn.k_proj.weight": rnd(shape.kv_heads * hd, shape.hidden),
            p + "self_attn.v_proj.weight": rnd(shape.kv_heads * hd, shape.hidden),
            p + "self_attn.o_proj.weight": rnd(shape.hidden, shape.heads * hd),
            p + "mlp.gate_proj.weight": rnd(shape.intermediate, shape.hidden),
            p + "mlp.up_proj.weight": rnd(shape.intermediate, shape.hidden),
            p + "mlp.down_proj.weight": rnd(shape.hidden, shape.intermediate),
            p + "input_layernorm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
        })
    tmp = src.with_name(src.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(str(tmp))
    if src.exists():
        shutil.rmtree(src)
    os.replace(tmp, src)
    return src


def _link_weights(src: Path, dst: Path) -> None:
    """``dst`` (made if missing) links every safetensors file of ``src``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.safetensors"):
        link = dst / f.name
        if link.is_symlink() and link.resolve() != f.resolve():
            link.unlink()  # a view of another shape's weights
        if not link.exists():
            link.symlink_to(f.resolve())


def _view(src: Path, dst: Path, tag: str, tokenizer_dir: Path) -> Path:
    """A model directory linking ``src``'s weights, with its own config tag."""
    from prefillshare.app.models.checkpoint import copy_tokenizer

    _link_weights(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    cfg[TAG_KEY] = tag
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    copy_tokenizer(tokenizer_dir, dst)
    return dst


@dataclass(frozen=True)
class ModelSet:
    """Directories for the three systems, decoders indexed 0..n-1."""

    base: str
    shared: tuple[str, ...]   # system a decoders (manifest -> base); also system c
    own: tuple[str, ...]      # system b decoders (manifest -> themselves)
    kv_bytes_per_token: int
    params: int
    description: str
    adapters: tuple[str, ...] = ()  # *-lora systems: LoRA adapter directories of base
    # --driver chat: the same adapters declaring BENCH_CHAT_TEMPLATE and JSON tool calls, laid out
    # shared-first (a-sf-lora) and system-first (a-sys-lora); the template file (stock servers)
    shared_first: tuple[str, ...] = ()
    system_first: tuple[str, ...] = ()
    chat_template: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _manifest(d: Path, agent: str, module_id: str, tok_hash: str) -> None:
    from prefillshare.app.models.manifest import DecodeManifest, write_manifest

    write_manifest(d, DecodeManifest(agent, module_id, tok_hash, {"method": "cache_conditioned",
                                                                  "note": "benchmark: random weights"}))


def random_models(root: str | Path, n: int, shape: ModelShape, tokenizer_dir: str | Path,
                  dtype: str = "auto", lora_rank: int = 16) -> ModelSet:
    """Base + n shared-prefill decoders + n own-prefill decoders over one random weight file,
    and n random LoRA adapters of the base (rank ``lora_rank``) for the *-lora systems."""
    from prefillshare.app.models.identity import prefill_module_id, tokenizer_hash

    root, tokenizer_dir = Path(root), Path(tokenizer_dir)
    src = _random_source(root, shape, tokenizer_dir)
    base = _view(src, root / "base", "base", tokenizer_dir)
    base_id, tok_hash = prefill_module_id(base), tokenizer_hash(base)
    shared, own = [], []
    for i in range(n):
        d = _view(src, root / f"dec-{i}", f"dec-{i}", tokenizer_dir)
        _manifest(d, f"agent{i}", base_id, tok_hash)
        shared.append(str(d))
        o = _view(src, root / f"own-{i}", f"own-{i}", tokenizer_dir)
        _manifest(o, f"agent{i}", prefill_module_id(o), tok_hash)
        own.append(str(o))
    adapters = tuple(str(random_adapter(root / f"lora-{i}", base, f"agent{i}", lora_rank, seed=100 + i))
                     for i in range(n))
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    params = shape.params(vocab)
    template = root / "chat_template.jinja"
    template.write_text(BENCH_CHAT_TEMPLATE, encoding="utf-8")
    return ModelSet(str(base), tuple(shared), tuple(own), kv_bytes_per_token(base, dtype), params,
                    f"random-weight Llama {params / 1e6:.0f}M (hidden {shape.hidden}, {shape.layers} layers, "
                    f"{shape.heads} heads, {shape.kv_heads} KV heads), computed in {compute_dtype.resolve(dtype)}; "
                    f"random LoRA adapters rank {lora_rank} on all 7 projections", adapters,
                    chat_adapters(root, adapters, "shared_first"), chat_adapters(root, adapters, "system_first"),
                    str(template))


def shipped_models(root: str | Path, checkpoints: str | Path, n: int, dtype: str = "auto") -> ModelSet:
    """The shipped base and its first n decoders; system b gets own-identity views of them."""
    from prefillshare.app.models.identity import prefill_module_id, tokenizer_hash

    root, ck = Path(root), Path(checkpoints)
    base = ck / "base"
    decs = sorted(p for p in (ck / "decoders").glob("*") if (p / "prefillshare.json").is_file())
    if not (base / "config.json").is_file() or len(decs) < n:
        raise ValueError(f"--models shipped: need {ck}/base and >= {n} decoders under {ck}/decoders "
                         f"(found {len(decs)}); train them with `prefillshare train` or use --models random")
    own = []
    for i, d in enumerate(decs[:n]):
        o = _view(d, root / f"own-{i}", f"own-{i}", base)
        _manifest(o, d.name, prefill_module_id(o), tokenizer_hash(o))
        own.append(str(o))
    return ModelSet(str(base), tuple(str(d) for d in decs[:n]), tuple(own), kv_bytes_per_token(base, dtype), 0,
                    f"shipped checkpoints ({ck}): base + {', '.join(d.name for d in decs[:n])}, "
                    f"computed in {compute_dtype.resolve(dtype)}")


# The chat template of --driver chat's decoders and stock servers: the shipped chat suite's
# ``role:\ncontent`` turns, a generation prompt, and a request's ``tools`` (which vLLM hands to
# templates; the app does not) as a first system turn written the way the app writes a tools line
# (deployments/ingress/tools.py ``tools_line``), so a stock server's prompt is the app's system-first prompt.
BENCH_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{ 'system:\\ntools: ' }}{%- for t in tools -%}{%- set f = t['function'] -%}"
    "{{ f['name'] + '(' + (((f.get('parameters') or {}).get('properties') or {}) | list | join(', ')) + ')' }}"
    "{%- if f.get('description') -%}{{ ': ' + f['description'] }}{%- endif -%}"
    "{%- if not loop.last -%}{{ '; ' }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}"
    "{{ '\\nassistant: ' + (m['content'] or '') + eos_token }}"
    "{%- else -%}{%- if not loop.first or tools -%}{{ '\\n' }}{%- endif -%}"
    "{{ m['role'] + ':\\n' + (m['content'] or '') }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\nassistant:' }}{%- endif -%}"
)


def chat_adapters(root: str | Path, adapters: tuple[str, ...], layout: str) -> tuple[str, ...]:
    """Views of ``adapters`` (weights linked) whose manifests declare BENCH_CHAT_TEMPLATE in
    ``layout`` (shared_first / system_first) and JSON tool calls, as a trained chat decoder's would."""
    from dataclasses import replace

    from prefillshare.app.models.manifest import read_manifest, write_manifest
    from prefillshare.app.rendering import TEMPLATE_FILE, Renderer

    fmt = Renderer.chat(BENCH_CHAT_TEMPLATE, layout=layout).fmt
    out = []
    for i, src in enumerate(Path(a) for a in adapters):
        dst = Path(root) / f"lora-{layout.replace('_', '-')}-{i}"
        _link_weights(src, dst)
        shutil.copyfile(src / "adapter_config.json", dst / "adapter_config.json")
        (dst / TEMPLATE_FILE).write_text(BENCH_CHAT_TEMPLATE, encoding="utf-8")
        write_manifest(dst, replace(read_manifest(src), prompt=fmt, tool_call_format="json"))
        out.append(str(dst))
    return tuple(out)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(out_dir: str | Path, base_dir: str | Path, agent: str, rank: int, seed: int,
                   b_std: float = 0.01, targets: tuple[str, ...] = LORA_TARGETS) -> Path:
    """A PEFT LoRA adapter of ``base_dir`` with random A and B (PEFT itself starts B at zero, which
    would leave the base unchanged), plus its prefillshare.json (adapter block naming the base).
    A large ``b_std`` changes the base's greedy tokens visibly (tests); speed does not depend on it."""
    import torch
    from safetensors.torch import save_file

    from prefillshare.app.models.identity import prefill_module_id, tokenizer_hash
    from prefillshare.app.models.manifest import AdapterSpec, DecodeManifest, write_manifest

    out, base = Path(out_dir), Path(base_dir)
    cfg = json.loads((base / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}
    where = {t: "self_attn" if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp" for t in targets}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        for t in targets:
            fan_in, fan_out = dims[t]
            key = f"base_model.model.model.layers.{i}.{where[t]}.{t}"
            state[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            state[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_std
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "target_modules": list(targets), "bias": "none", "base_model_name_or_path": str(base),
        "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None}, indent=2))
    base_id = prefill_module_id(base)
    write_manifest(out, DecodeManifest(
        agent, base_id, tokenizer_hash(base), {"method": "cache_conditioned", "note": "random LoRA weights"},
        adapter=AdapterSpec(base_id, rank, tuple(targets), float(rank))))
    return out
