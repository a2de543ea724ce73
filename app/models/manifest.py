"""The decode-module manifest ``prefillshare.json``, written beside a decoder's checkpoint.

It says which prefill module the decoder consumes (base id, tokenizer hash), how it was
trained, how its prompts are rendered (so serving builds the token ids training used) and,
for an adapter-only checkpoint, which LoRA adapter it is and on which base it applies. A
server decides from it, before loading anything, whether the decoder may use the shared
prefill or must prefill privately.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from prefillshare.app.errors import PrefillShareLibraryError

MANIFEST_NAME = "prefillshare.json"
METHODS = ("cache_conditioned", "full_ft", "layer_split")
PROMPT_FORMATS = ("suite", "text", "chat_template")
# Where an agent's own text (system prompt, tools, its question) goes (app/rendering.py
# ``Renderer.arrange``): after the shared conversation, so agents share its prefill, or first,
# as chat templates put it. Manifests without the field were trained system-first.
LAYOUTS = ("shared_first", "system_first")
ADAPTER_FORMATS = ("peft",)
# How a decoder calls tools (deployments/ingress/tools.py): "json" = a JSON-schema-constrained
# {"name", "arguments"} object the app renders and reads back as OpenAI tool_calls.
TOOL_CALL_FORMATS = ("json",)


class ManifestError(PrefillShareLibraryError, ValueError):
    """Missing or malformed manifest; the message names the file."""


@dataclass(frozen=True)
class PromptFormat:
    """How a decoder's prompts were rendered into token ids in training.

    - ``suite``: ``context + "\\n" + instruction``; chat turns join as context, the last user
      turn is the instruction; answers are generated with a leading space, then eos.
    - ``text``: prompt/completion data, the prompt text as given (agents: ``context\\ninstruction``).
    - ``chat_template``: the Jinja chat template whose sha256 is ``template_sha256`` (stored in the
      decoder directory as ``template_file``), applied with ``add_generation_prompt``; an agent
      request is ``[system?] + user(context + "\\n" + instruction)``.

    ``layout`` says where the agent's own text goes: ``shared_first`` renders the shared
    conversation first and the agent's system prompt, tools and question after it (so agents with
    different system prompts share one prefill); ``system_first`` keeps the messages in their order.
    """

    format: str = "suite"
    template_sha256: str | None = None
    template_file: str | None = None
    system: str | None = None  # the system turn agent requests get
    layout: str = "system_first"  # one of LAYOUTS

    def to_dict(self) -> dict:
        return {k: v for k, v in (("format", self.format), ("template_sha256", self.template_sha256),
                                  ("template_file", self.template_file), ("system", self.system),
                                  ("layout", self.layout)) if v is not None}


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter-only decoder: PEFT LoRA weights that apply on top of the prefill module itself.

    ``base_prefill_module_id`` is the id of the model the adapter was trained on (the base),
    so one copy of the base weights serves the prefill and, with the adapter on, the decode.
    """

    base_prefill_module_id: str
    rank: int
    target_modules: tuple[str, ...]
    alpha: float | None = None
    format: str = "peft"

    def to_dict(self) -> dict:
        out = {"format": self.format, "base_prefill_module_id": self.base_prefill_module_id, "rank": self.rank,
               "target_modules": list(self.target_modules)}
        if self.alpha is not None:
            out["alpha"] = self.alpha
        return out


@dataclass(frozen=True)
class DecodeManifest:
    agent: str
    prefill_module_id: str
    tokenizer_hash: str
    training: dict = field(default_factory=dict)  # {"method": ..., "steps", "lr", "lora", "shared_layers", ...}
    kind: str = "decode_module"
    prompt: PromptFormat = PromptFormat()
    adapter: AdapterSpec | None = None
    tool_call_format: str | None = None  # one of TOOL_CALL_FORMATS; None: the decoder does not call tools

    @property
    def method(self) -> str:
        return self.training.get("method", "")

    @property
    def weights(self) -> str:
        """"full": an HF checkpoint; "upper_layers": only the layers above the shared ones (layer-split);
        "adapter": PEFT adapter weights only (applied on the base)."""
        if self.adapter is not None:
            return "adapter"
        return self.training.get("weights", "full")

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "agent": self.agent, "prefill_module_id": self.prefill_module_id,
               "tokenizer_hash": self.tokenizer_hash, "training": self.training, "prompt": self.prompt.to_dict()}
        if self.adapter is not None:
            out["adapter"] = self.adapter.to_dict()
        if self.tool_call_format is not None:
            out["tool_call_format"] = self.tool_call_format
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_manifest(directory: str | Path, manifest: DecodeManifest) -> Path:
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_name(MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def _str_field(path: Path, data: dict, key: str, where: str = "") -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{path}: field {where + key!r} missing or not a string")
    return value


def _prompt(path: Path, data) -> PromptFormat:
    if data is None:  # manifests written before the field existed: the suite rendering
        return PromptFormat()
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: field 'prompt' must be an object")
    fmt = data.get("format", "suite")
    if fmt not in PROMPT_FORMATS:
        raise ManifestError(f"{path}: prompt.format must be one of {', '.join(PROMPT_FORMATS)}, got {fmt!r}")
    layout = data.get("layout", "system_first")
    if layout not in LAYOUTS:
        raise ManifestError(f"{path}: prompt.layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    for key in ("template_sha256", "template_file", "system"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ManifestError(f"{path}: field 'prompt.{key}' must be a string")
    if fmt == "chat_template":
        _str_field(path, data, "template_sha256", "prompt.")
        _str_field(path, data, "template_file", "prompt.")
        if "/" in data["template_file"] or data["template_file"].startswith("."):
            raise ManifestError(f"{path}: prompt.template_file must name a file inside the decoder directory")
    return PromptFormat(fmt, data.get("template_sha256"), data.get("template_file"), data.get("system"), layout)


def _adapter(path: Path, data) -> AdapterSpec | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: field 'adapter' must be an object")
    fmt = data.get("format")
    if fmt not in ADAPTER_FORMATS:
        raise ManifestError(f"{path}: adapter.format must be one of {', '.join(ADAPTER_FORMATS)}, got {fmt!r}")
    base = _str_field(path, data, "base_prefill_module_id", "adapter.")
    rank = data.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ManifestError(f"{path}: field 'adapter.rank' must be a positive integer, got {rank!r}")
    targets = data.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ManifestError(f"{path}: field 'adapter.target_modules' must be a non-empty list of module names")
    alpha = data.get("alpha")
    if alpha is not None and (not isinstance(alpha, int | float) or isinstance(alpha, bool)):
        raise ManifestError(f"{path}: field 'adapter.alpha' must be a number")
    return AdapterSpec(base, rank, tuple(targets), alpha, fmt)


def read_manifest(directory: str | Path) -> DecodeManifest:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{directory}: no {MANIFEST_NAME} (not a decode module; train it with `prefillshare train`)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not UTF-8 text") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: expected a JSON object")
    if data.get("kind") != "decode_module":
        raise ManifestError(f"{path}: kind must be 'decode_module', got {data.get('kind')!r}")
    for key in ("agent", "prefill_module_id", "tokenizer_hash"):
        _str_field(path, data, key)
    training = data.get("training", {})
    if not isinstance(training, dict) or training.get("method") not in METHODS:
        raise ManifestError(f"{path}: training.method must be one of {', '.join(METHODS)}")
    adapter = _adapter(path, data.get("adapter"))
    if adapter is not None and training.get("method") == "layer_split":
        raise ManifestError(f"{path}: an adapter-only decoder cannot be a layer_split baseline")
    tools = data.get("tool_call_format")
    if tools is not None and tools not in TOOL_CALL_FORMATS:
        raise ManifestError(f"{path}: tool_call_format must be one of {', '.join(TOOL_CALL_FORMATS)}, got {tools!r}")
    return DecodeManifest(data["agent"], data["prefill_module_id"], data["tokenizer_hash"], training,
                          prompt=_prompt(path, data.get("prompt")), adapter=adapter, tool_call_format=tools)
