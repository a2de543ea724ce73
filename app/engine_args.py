"""serve_config.yaml's engine, LoRA and pool settings -> what an engine and its connector take.

The one translation point: :func:`engine_config` turns a deployment's ``engine`` settings (and
its LoRA group) into an :class:`prefillshare.app.engine.async_engine.EngineConfig`, :func:`engine_env` gives
the env vars of its replica, the pool's own settings go to its PoolSpec through the hand-over (app/engine/modes.py).
docs/serving.md's settings table lists where each setting goes (tests/test_settings_table.py).
"""
from __future__ import annotations

import math
import os

from prefillshare.app.config import (
    AppConfig,
    ConfigError,
    DecoderConfig,
    EngineSettings,
    LoRAGroup,
    Placement,
    PrefillModuleConfig,
)

# vLLM on the CPU runs its worker in a third process unless this is off; inside EngineCore it
# measured less memory and CPU per session (docs/benchmarks.md, "Engine footprint"). Only with
# threads_bind 'nobind': vLLM pins OpenMP threads to a core list only from its multiprocess executor.
CPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine_env(cfg: AppConfig, p: Placement, eng: EngineSettings) -> dict[str, str]:
    """The one set of env vars of an engine: its engine core's, and its replica's Ray runtime env
    (there beside Serve's own replica settings, ``REPLICA_ENV`` in deployments/ray_internals.py)."""
    base = dict(CPU_ENGINE_ENV) if not p.num_gpus and eng.threads_bind == "nobind" else {}
    return {**base, "VLLM_CPU_OMP_THREADS_BIND": eng.threads_bind, "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", **cfg.engine_env, **p.env}


def bound_cores(threads_bind: str) -> int | None:
    """How many cores ``VLLM_CPU_OMP_THREADS_BIND`` gives one engine's OpenMP threads (None: 'nobind',
    as many threads as the replica's num_cpus rounded down, at least one)."""
    if threads_bind == "nobind":
        return None
    if threads_bind == "auto":
        return os.cpu_count() or 1
    count = 0
    for part in threads_bind.split("|")[0].split(","):  # a list per rank after '|': the first rank's
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def oversubscribed_threads(cfg: AppConfig) -> list[str]:
    """Each CPU engine whose ``threads_bind`` runs more OpenMP threads than its replica reserves cores:
    vLLM's threads spin on every core they are given, so the Router, Serve's proxy and the other
    engines on the node wait behind them (measured on 2 cores: '0-1' under the default app's 0.5-CPU
    prefill module took in-engine adapters from 0.83x to 0.61x of one engine's throughput,
    docs/serving.md "Threads on a node shared with the Router and Serve's proxy"). One line per engine, naming the field and what to set instead."""
    engines: list[tuple[str, PrefillModuleConfig | DecoderConfig]] = [
        *((f"prefill_modules[{i}]", p) for i, p in enumerate(cfg.prefill_modules)),
        *((f"decoders[{i}]", d) for i, d in enumerate(cfg.decoders))]
    out = []
    for where, dep in engines:
        p, bind = dep.placement, dep.engine.threads_bind
        cores = bound_cores(bind)
        if p.num_gpus or cores is None or cores <= max(1, math.ceil(p.num_cpus)):
            continue
        out.append(f"{where}.engine.threads_bind: {bind!r} runs {cores} OpenMP threads on {cores} cores, where the "
                   f"replica reserves {where}.placement.num_cpus={p.num_cpus} beside the Router, Serve's proxy and "
                   f"the other engines; set threads_bind: nobind (as many threads as num_cpus, at least one), or "
                   f"num_cpus: {cores} on a node with cores to spare")
    return out


# AsyncEngineArgs fields the app sets itself# AsyncEngineArgs fields the app sets itself: from the project's own settings, or per deployment.
APP_ENGINE_ARGS = frozenset({
    "model", "tokenizer", "skip_tokenizer_init", "load_format", "kv_transfer_config", "enable_prefix_caching",
    "structured_outputs_config", "disable_log_stats", "enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras",
})


def lora_args(cfg: AppConfig, lora: LoRAGroup | None) -> dict:
    """A LoRA group's engine settings: its adapters as (name, resolved path) pairs, the in-engine
    decoders among them (a prefill module's ``lora_decoders``), ``max_lora_rank`` and ``max_loras``
    (None: as many as its adapters; EngineConfig also gives vLLM's max_cpu_loras that number, so
    every adapter stays loaded)."""
    if lora is None:
        return {}
    in_engine = getattr(lora, "lora_decoders", [])
    adapters = lora.adapters + in_engine
    if not adapters:
        return {}
    return {"lora_adapters": tuple((a.name, str(cfg.path(a.path))) for a in adapters),
            "handover_adapters": tuple(a.name for a in in_engine),
            "max_lora_rank": lora.max_lora_rank, "max_loras": lora.max_loras}


def check_engine_kwargs(cfg: AppConfig) -> None:
    """Every ``engine.engine_kwargs`` key must be an AsyncEngineArgs field the app does not set itself;
    ConfigError naming the field otherwise (before any engine starts)."""
    import dataclasses

    deployments: list[tuple[str, PrefillModuleConfig | DecoderConfig]] = [
        (f"prefill_modules[{i}]", p) for i, p in enumerate(cfg.prefill_modules)]
    deployments += [(f"decoders[{i}]", d) for i, d in enumerate(cfg.decoders)]
    if not any(dep.engine.engine_kwargs for _, dep in deployments):
        return  # nothing to check: vLLM is not imported
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    own = set(EngineSettings.model_fields) - {"engine_kwargs", "threads_bind", "serving_niceness"}
    for where, dep in deployments:
        for key in dep.engine.engine_kwargs:
            field = f"{where}.engine.engine_kwargs.{key}"
            if key in own:
                raise ConfigError(f"{field}: set it as {where}.engine.{key}")
            if key in APP_ENGINE_ARGS:
                raise ConfigError(f"{field}: set by the app (LoRA settings go on the deployment: max_loras, "
                                  "max_lora_rank, adapters)")
            if key not in known:
                raise ConfigError(f"{field}: not a vLLM engine argument (AsyncEngineArgs)")


# the files that decide how an engine tokenizes and detokenizes
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def engine_tokenizer(cfg: AppConfig, model: str) -> str:
    """The tokenizer folder an engine loads: the model's own when its tokenizer files are the
    app's, byte for byte; otherwise the app's ``tokenizer``. vLLM reads a tokenizer folder's
    config.json as a model config, and a tokenizer-only folder fails that read twice, 2 s apart,
    with an ERROR line, in the replica and again in its engine core: 4 s at every engine start."""
    from pathlib import Path

    app_tok, own = Path(cfg.path(cfg.tokenizer)), Path(cfg.path(model))

    def same(name: str) -> bool:
        a, b = app_tok / name, own / name
        return a.is_file() == b.is_file() and (not a.is_file() or a.read_bytes() == b.read_bytes())

    if (own / "config.json").is_file() and (own / "tokenizer.json").is_file() and all(map(same, _TOKENIZER_FILES)):
        return str(own)
    return str(app_tok)


def engine_config(cfg: AppConfig, model: str, eng: EngineSettings, placement: Placement,
                  kv_transfer_config: dict | None, lora: LoRAGroup | None = None):
    """The EngineConfig of one engine deployment: ``eng``'s settings under their vLLM names, its LoRA group's."""
    from prefillshare.app.engine.async_engine import EngineConfig

    return EngineConfig(
        model=str(cfg.path(model)), tokenizer=engine_tokenizer(cfg, model), dtype=eng.dtype,
        kv_cache_memory_bytes=eng.kv_cache_memory_bytes, max_model_len=eng.max_model_len, block_size=eng.block_size,
        max_num_seqs=eng.max_num_seqs, enforce_eager=eng.enforce_eager, seed=eng.seed,
        serving_niceness=eng.serving_niceness,
        gpu_memory_utilization=eng.gpu_memory_utilization, engine_kwargs=dict(eng.engine_kwargs),
        kv_transfer_config=kv_transfer_config, request_timeout_s=cfg.limits.request_timeout_s,
        extra_env=engine_env(cfg, placement, eng), **lora_args(cfg, lora),
    )


