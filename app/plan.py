"""The app's plan: an AppConfig resolved once, before any engine starts.

:func:`plan_app` reads each served decoder's manifest once and gives one :class:`DecoderPlan`
per served name: the prefill module that feeds it (or the code and readable reason it prefills
privately), its checked Renderer, its tool-call format and its LoRA adapter. A full-weight
decoder that cannot share prefills privately; a decode group's adapter that cannot run on the
group's engine fails the build with the config field named (:class:`ConfigError`).

:func:`plan_app` also renders one probe request through every decoder of each prefill module
(app/sharing.py): a decoder that would prefill an agent's own system prompt before the shared
context is named in the deploy log, or fails the build with ``sharing.require``.

The plan also builds the app's hand-over once (app/engine/modes.py reads the config's ``handover``,
and nothing after it); engine deployments receive the :class:`Handover` it gives.

The plan holds plain data and crosses to every Router and Orchestrator replica as it is: they
neither read a manifest nor check a rendering again.
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prefillshare.app.config import (
    AdapterConfig,
    AppConfig,
    ConfigError,
    DecoderConfig,
    LimitsConfig,
    PrefillModuleConfig,
)
from prefillshare.app.engine import compute_dtype
from prefillshare.app.engine.handover import Handover
from prefillshare.app.engine.modes import handover_for
from prefillshare.app.engine_args import check_engine_kwargs, oversubscribed_threads
from prefillshare.app.prompt_split import Activation
from prefillshare.app.rendering import Renderer, RenderError
from prefillshare.app.sharing import ModuleSharing, module_sharing

if TYPE_CHECKING:
    from prefillshare.app.models.manifest import DecodeManifest, ManifestError

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ModulePlan:
    """A prefill module as resolved at build time."""

    name: str
    module_id: str
    block_size: int


@dataclass(frozen=True)
class DecoderPlan:
    """A served decoder as resolved at build time: which prefill module feeds it, or why none does."""

    name: str
    prefill_module: str | None
    private_reason: str | None  # short code for metrics, e.g. "incompatible"
    private_detail: str | None  # readable reason
    kv_bytes_per_token: int
    max_model_len: int
    group: str | None = None  # decode group (config decoder name) whose engine serves this LoRA decoder
    adapter: str | None = None  # LoRA adapter name in that engine (None: a full-weight decoder)
    prefill_adapter: str | None = None  # the prefill module computes this decoder's KV with this adapter
    in_engine: bool = False  # served by its prefill module's own engine (lora_decoders): nothing handed over
    tool_call_format: str | None = None  # from the decoder's manifest: how it calls tools (deployments/ingress/tools.py)
    renderer: Renderer = field(default_factory=Renderer)  # checked against the app's tokenizer at build time


@dataclass(frozen=True)
class AppPlan:
    tokenizer: str
    modules: tuple[ModulePlan, ...]
    decoders: tuple[DecoderPlan, ...]
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    sharing: tuple[ModuleSharing, ...] = ()  # per prefill module: what its decoders share of a probe
    handover: Handover | None = None  # how the base's KV reaches the decoders (app/engine/modes.py)

    @functools.cached_property
    def _by_name(self) -> tuple[dict[str, DecoderPlan], dict[str, ModulePlan]]:
        """Built once per process (the plan crosses Ray pickled): requests look names up, not scan."""
        return {d.name: d for d in self.decoders}, {m.name: m for m in self.modules}

    def serves(self, name: str) -> bool:
        return name in self._by_name[0]

    def decoder(self, name: str) -> DecoderPlan:
        """The served decoder ``name`` (KeyError if none: the ingress checks names with :meth:`serves`)."""
        return self._by_name[0][name]

    def module(self, name: str) -> ModulePlan:
        """The prefill module ``name`` (KeyError if none)."""
        return self._by_name[1][name]

    @property
    def renderers(self) -> dict[str, Renderer]:
        """{served decoder name: its checked Renderer}."""
        return {d.name: d.renderer for d in self.decoders}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes of K and V over all layers for one token (what a decoder loads per shared token)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * int(cfg["num_hidden_layers"]) * int(heads) * int(head_dim) * compute_dtype.BYTES[compute_dtype.resolve(dtype)]


@dataclass(frozen=True)
class _Served:
    """One name a decoder entry serves: the decoder itself, or one adapter of a decode group."""

    where: str  # the config field: decoders[i], decoders[i].adapters[j] or prefill_modules[i].lora_decoders[j]
    decoder: DecoderConfig | PrefillModuleConfig  # the entry whose engine serves it
    adapter: AdapterConfig | None
    name: str
    path: Path
    manifest: DecodeManifest | ManifestError  # the ManifestError reading it raised, if it did

    @property
    def in_engine(self) -> bool:
        """A prefill module's own LoRA decoder (``lora_decoders``)."""
        return isinstance(self.decoder, PrefillModuleConfig)


def _served(cfg: AppConfig) -> list[_Served]:
    """Every served name with its manifest, each manifest read once."""
    out = []
    entries: list[tuple[str, AdapterConfig | None, str, Path]]
    for i, d in enumerate(cfg.decoders):
        entries = ([(f"decoders[{i}].adapters[{j}]", a, a.name, cfg.path(a.path)) for j, a in enumerate(d.adapters)]
                   if d.adapters else [(f"decoders[{i}]", None, d.name, cfg.path(d.model))])
        for where, a, name, path in entries:
            out.append(_Served(where, d, a, name, path, _manifest(path)))
    for i, p in enumerate(cfg.prefill_modules):
        for j, a in enumerate(p.lora_decoders):
            path = cfg.path(a.path)
            out.append(_Served(f"prefill_modules[{i}].lora_decoders[{j}]", p, a, a.name, path, _manifest(path)))
    return out


def _manifest(path: Path) -> DecodeManifest | ManifestError:
    """The directory's DecodeManifest, or the ManifestError reading it raised."""
    from prefillshare.app.models.manifest import ManifestError, read_manifest

    try:
        return read_manifest(path)
    except ManifestError as e:
        return e


class _Tokenizer:
    """The app's tokenizer, loaded on first use: only a chat template needs it to be checked, and
    loading it imports transformers (seconds of CPU in every app build)."""

    def __init__(self, path: Path):
        self.path, self._tok = path, None

    def __call__(self):
        if self._tok is None:
            from prefillshare.app.training.tokenizer import load_tokenizer

            self._tok = load_tokenizer(self.path)
        return self._tok


def _renderer(s: _Served, tok: _Tokenizer) -> Renderer:
    """The served name's recorded rendering, checked against the app's tokenizer; the suite
    rendering without a manifest (not trained here)."""
    if isinstance(s.manifest, Exception):
        return Renderer()
    try:
        renderer = Renderer.for_decoder(s.path, s.manifest)
    except RenderError as e:
        raise RenderError(f"{s.where} ({s.name}): {e}") from None
    if renderer.format == "chat_template":
        renderer.check(tok(), f"{s.where} ({s.name}): {s.path}")
    return renderer


def decoder_renderers(cfg: AppConfig) -> dict[str, Renderer]:
    """{served decoder name: its checked Renderer}, without resolving the rest of the plan (a config
    whose checkpoints are manifests only); raises :class:`RenderError` naming the config field."""
    tok = _Tokenizer(cfg.path(cfg.tokenizer))
    return {s.name: _renderer(s, tok) for s in _served(cfg)}


def _check_adapter(s: _Served, group_id: str) -> None:
    """A decode group's adapter (or a prefill module's in-engine decoder) must run on that engine's
    model; an in-engine decoder must also be cache-conditioned. ConfigError naming the field otherwise."""
    from prefillshare.app.models import compat
    from prefillshare.app.models.identity import CheckpointError

    a, d, m = s.adapter, s.decoder, s.manifest
    assert a is not None, "called for adapters only"
    if s.in_engine and isinstance(m, Exception) and Activation.of_adapter(s.path).is_alora:
        _check_alora(s)  # PEFT's Activated LoRA, brought as PEFT wrote it: its own format says how it acts
        return
    if isinstance(m, Exception):
        raise ConfigError(f"{s.where}.path: {m}")
    if m.adapter is None:
        raise ConfigError(f"{s.where}.path: {s.path} is not an adapter-only decoder (its manifest has no 'adapter' "
                          "block); serve a full checkpoint as its own decoder instead")
    if m.adapter.rank != a.rank:
        raise ConfigError(f"{s.where}.rank: {a.rank} in the config, the adapter's manifest says {m.adapter.rank}")
    try:
        compat.check_adapter_files(s.path, m.adapter)
    except CheckpointError as e:
        raise ConfigError(f"{s.where}.path: {e}") from None
    if m.adapter.base_prefill_module_id != group_id:
        raise ConfigError(f"{s.where}.path: adapter {a.name!r} belongs to base {m.adapter.base_prefill_module_id},"
                          f" the {'module' if s.in_engine else 'group'}'s model {d.model} is {group_id} (an adapter "
                          "only runs on the weights it was trained on)")
    if s.in_engine and m.method != "cache_conditioned":
        raise ConfigError(f"{s.where}.path: adapter {a.name!r} was trained {m.method or 'without a method'!r}, not "
                          "cache-conditioned: in-engine it would read the base's KV it was never trained on (naive "
                          "reuse). Retrain it with `prefillshare train --lora` or serve it in a decode group "
                          "(decoders[].adapters) with its own prefill")


def _check_alora(s: _Served) -> None:
    """An Activated LoRA adapter without the project's manifest: trained by PEFT to act from its
    invocation on over the base's KV before it, which is what an in-engine decoder reads. Its rank
    must be the config's (vLLM sizes the module's slots by max_lora_rank)."""
    assert s.adapter is not None
    peft = json.loads((s.path / "adapter_config.json").read_text())
    if int(peft.get("r", 0)) != s.adapter.rank:
        raise ConfigError(f"{s.where}.rank: {s.adapter.rank} in the config, the adapter's adapter_config.json "
                          f"says r={peft.get('r')}")


def _engine_mismatch(base: PrefillModuleConfig, d: DecoderConfig) -> list[str]:
    reasons = []
    if base.engine.block_size != d.engine.block_size:
        reasons.append(f"block_size differs: prefill module {base.engine.block_size}, decoder {d.engine.block_size}")
    if base.engine.dtype != d.engine.dtype:
        reasons.append(f"engine dtype differs: prefill module {base.engine.dtype}, decoder {d.engine.dtype}")
    return reasons


def _sharing(cfg: AppConfig, s: _Served, d: DecoderConfig,
             module_ids: dict[str, str]) -> tuple[str | None, str | None, str | None]:
    """(prefill module, prefill adapter, None) when ``s`` (served by decoder entry ``d``) reads a module's
    KV, else (None, code, reason)."""
    from prefillshare.app.models import compat
    from prefillshare.app.models.identity import CheckpointError
    from prefillshare.app.models.manifest import ManifestError

    m = s.manifest
    if d.prefill_module is None:
        return None, "disabled", "prefill_module is null in the config"
    if isinstance(m, Exception):
        return None, "no_manifest", str(m)
    name = (d.prefill_module if d.prefill_module != "auto"
            else next((n for n, i in module_ids.items() if i == m.prefill_module_id), None))
    if name is None:
        return None, "no_prefill_module", (f"manifest names prefill module {m.prefill_module_id}; "
                                           f"configured: {module_ids}")
    base = cfg.prefill_module(name)
    try:
        reasons = list(compat.check(cfg.path(base.model), s.path, base_id=module_ids[name], manifest=m).reasons)
    except (ManifestError, CheckpointError) as e:
        reasons = [str(e)]
    reasons += _engine_mismatch(base, d)
    own = None
    if s.adapter is not None and base.adapters:  # a per-adapter prefill: the adapter's own KV, computed there
        own = next((b.name for b in base.adapters if b.name == s.adapter.name), None)
        if own is None:
            reasons.append(f"prefill module {name} computes per-adapter KV and holds no adapter named {s.name!r}")
    if reasons:
        return None, "incompatible", "; ".join(reasons)
    return name, own, None


def _resolve(cfg: AppConfig, s: _Served, module_ids: dict[str, str], group_ids: dict[str, str], bpt: int,
             tok: _Tokenizer) -> DecoderPlan:
    """One served name's plan."""
    d = s.decoder
    tools = None if isinstance(s.manifest, Exception) else s.manifest.tool_call_format
    if isinstance(d, PrefillModuleConfig):  # an in-engine LoRA decoder (lora_decoders)
        _check_adapter(s, module_ids[d.name])
        return DecoderPlan(s.name, d.name, None, None, kv_bytes_per_token=bpt, max_model_len=d.engine.max_model_len,
                           adapter=s.name, in_engine=True, tool_call_format=tools, renderer=_renderer(s, tok))
    group = adapter = None
    if s.adapter is not None:
        _check_adapter(s, group_ids[d.name])
        group, adapter = d.name, s.name
    renderer = _renderer(s, tok)
    module, own_or_code, reason = _sharing(cfg, s, d, module_ids)
    code, prefill_adapter = (own_or_code, None) if module is None else (None, own_or_code)
    if module is None:
        log.warning("decoder %s: private prefill (%s)", s.name, reason)
    return DecoderPlan(s.name, module, code, reason, kv_bytes_per_token=bpt, max_model_len=d.engine.max_model_len,
                       group=group, adapter=adapter, prefill_adapter=prefill_adapter, tool_call_format=tools,
                       renderer=renderer)


def plan_app(cfg: AppConfig) -> AppPlan:
    """The resolved plan; raises ConfigError (or RenderError) naming the field before any engine starts."""
    from prefillshare.app.models.identity import prefill_module_id

    cfg.check_paths()
    check_engine_kwargs(cfg)
    for line in oversubscribed_threads(cfg):
        log.warning("%s", line)
    module_ids = {p.name: prefill_module_id(cfg.path(p.model)) for p in cfg.prefill_modules}
    group_ids = {d.name: prefill_module_id(cfg.path(d.model)) for d in cfg.decoders if d.adapters}
    tok = _Tokenizer(cfg.path(cfg.tokenizer))
    # KV bytes per token of each engine entry (a decoder, a decode group, a module with lora_decoders), read once
    entries: list[DecoderConfig | PrefillModuleConfig] = [*cfg.decoders, *cfg.prefill_modules]
    bpt = {id(e): kv_bytes_per_token(cfg.path(e.model), e.engine.dtype) for e in entries}
    served = _served(cfg)
    decoders = tuple(_resolve(cfg, s, module_ids, group_ids, bpt[id(s.decoder)], tok) for s in served)
    for i, d in enumerate(cfg.decoders):
        read = sorted({p.prefill_module for p in decoders if p.group == d.name and p.prefill_module})
        if len(read) > 1:
            raise ConfigError(f"decoders[{i}].adapters: one decode group reads one prefill module's KV; its adapters "
                              f"name {read} (split them into groups or set decoders[{i}].prefill_module)")
    modules = tuple(ModulePlan(p.name, module_ids[p.name], p.engine.block_size) for p in cfg.prefill_modules)
    sharing = _check_sharing(cfg, decoders, tok, {s.name: s.where for s in served})
    return AppPlan(str(cfg.path(cfg.tokenizer)), modules, decoders, cfg.limits, sharing, handover_for(cfg))


def _check_sharing(cfg: AppConfig, decoders: tuple[DecoderPlan, ...], tok: _Tokenizer,
                   where: dict[str, str]) -> tuple[ModuleSharing, ...]:
    """Each prefill module's probe report; a decoder that shares nothing is logged, or with
    ``sharing.require`` fails the build naming its config entry (``where``: name -> config field)."""
    reports = []
    for p in cfg.prefill_modules:
        renderers = {d.name: d.renderer for d in decoders if d.prefill_module == p.name}
        if not renderers:
            continue
        report = module_sharing(tok(), p.name, renderers)
        log.info("prefill module %s: a fan-out of one probe to its %d decoders costs the base %d prompt tokens, "
                 "%.2fx one agent's prompt", p.name, len(renderers), report.fanout_tokens, report.ratio)
        for d in report.decoders:
            if d.problem is None:
                continue
            if cfg.sharing.require:
                raise ConfigError(f"{where[d.decoder]}: {d.problem} (sharing.require is on)")
            log.warning("%s: %s", where[d.decoder], d.problem)
        reports.append(report)
    return tuple(reports)
