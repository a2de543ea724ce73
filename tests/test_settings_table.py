"""docs/serving.md's settings table against the code: every engine, LoRA, placement and pool
setting (and limits.request_timeout_s, which engines take too) has a row; each row names where the
setting's value arrives (a vLLM engine argument, an EngineConfig field the project applies itself, an
env var, a Serve option or a PoolSpec field) and its default. A setting added without a row, a row
that names the wrong target or default, or a lower layer (EngineConfig, PoolSpec, the request
routers) with a default of its own, fails here."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefillshare.app.config import EngineSettings, LoRAGroup, Placement, PoolConfig, PrefillModuleConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
BASE = {"prefill_modules": [{"name": "base", "model": "checkpoints/base"}],
        "decoders": [{"name": "lookup", "model": "checkpoints/decoders/lookup"}]}

# setting -> (what the config says beside the defaults, the value its target must then hold)
PROBES: dict[str, tuple[dict[str, Any], Any]] = {
    "engine.dtype": ({"dtype": "bfloat16"}, "bfloat16"),
    "engine.max_model_len": ({"max_model_len": 512}, 512),
    "engine.kv_cache_memory_bytes": ({"kv_cache_memory_bytes": "64MiB"}, 64 << 20),
    "engine.gpu_memory_utilization": ({"gpu_memory_utilization": 0.5}, 0.5),
    "engine.block_size": ({"block_size": 64}, 64),
    "engine.max_num_seqs": ({"max_num_seqs": 3}, 3),
    "engine.enforce_eager": ({"enforce_eager": False}, False),
    "engine.seed": ({"seed": 7}, 7),
    "engine.threads_bind": ({"threads_bind": "0-1"}, "0-1"),
    "engine.serving_niceness": ({"serving_niceness": 7}, 7),
    "engine.engine_kwargs": ({"engine_kwargs": {"max_num_batched_tokens": 96, "max_logprobs": 5}},
                             {"max_num_batched_tokens": 96, "max_logprobs": 5}),
    "max_lora_rank": ({"max_lora_rank": 32}, 32),
    "max_loras": ({"max_loras": 3}, 3),
    "adapters": ({}, True),
    "lora_decoders": ({"lora_decoders": [{"name": "ie", "path": "checkpoints/chat/adapters/lookup", "rank": 8}]},
                      ("ie",)),
    "placement.num_replicas": ({"num_replicas": 3}, 3),
    "placement.autoscaling": ({"autoscaling": {"max_replicas": 3, "upscale_delay_s": 2}},
                              {"max_replicas": 3, "upscale_delay_s": 2}),
    "placement.num_cpus": ({"num_cpus": 0.125}, 0.125),
    "placement.num_gpus": ({"num_gpus": 1}, 1),
    "placement.max_ongoing_requests": ({"max_ongoing_requests": 7}, 7),
    "placement.max_queued_requests": ({"max_queued_requests": 5}, 5),
    "placement.placement_group_bundles": ({"placement_group_bundles": [{"CPU": 1.0}]}, [{"CPU": 1.0}]),
    "placement.placement_group_strategy": ({"placement_group_bundles": [{"CPU": 1.0}],
                                            "placement_group_strategy": "SPREAD"}, "SPREAD"),
    "placement.env": ({"env": {"PROBE_VAR": "on"}}, {"PROBE_VAR": "on"}),
    "pool.path": ({"path": "/dev/shm/probe"}, "/dev/shm/probe"),
    "pool.capacity_bytes": ({"capacity_bytes": "96MiB"}, 96 << 20),
    "pool.lease_timeout_s": ({"lease_timeout_s": 4.5}, 4.5),
    "pool.persist": ({"persist": True}, True),
    "pool.check": ({"check": "crc32"}, "crc32"),
    "limits.request_timeout_s": ({"request_timeout_s": 45.0}, 45.0),
}
# settings outside a deployment and the pool that engines take too
LIMITS = {"limits.request_timeout_s"}
# a prefill module's own settings (its engine's in-engine decoders)
MODULE = set(PrefillModuleConfig.model_fields) - set(LoRAGroup.model_fields) - {"name", "model", "placement", "engine"}


def _rows() -> list[list[str]]:
    text = (ROOT / "docs" / "serving.md").read_text()
    body = text.split("<!-- settings-table -->", 1)[1].split("<!-- /settings-table -->", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.strip().splitlines()[2:]]


def table() -> dict[str, list[str]]:
    """{setting: the targets its row names (the backticked names of the 'becomes' cell)}."""
    return {setting.strip("`"): re.findall(r"`([^`]+)`", becomes) for setting, becomes, _ in _rows()}


def documented_defaults() -> dict[str, Any]:
    """{setting: the default its row states (the first backticked value of the 'default' cell, as YAML)}."""
    return {setting.strip("`"): yaml.safe_load(re.findall(r"`([^`]+)`", default)[0]) for setting, _, default in _rows()}


def settings_in_code() -> set[str]:
    return ({f"engine.{f}" for f in EngineSettings.model_fields} | {f"placement.{f}" for f in Placement.model_fields}
            | set(LoRAGroup.model_fields) | {f"pool.{f}" for f in PoolConfig.model_fields} | LIMITS | MODULE)


def configured_default(setting: str) -> Any:
    """What a config that leaves ``setting`` out runs with (a decoder's, for deployment settings)."""
    cfg = load_config(BASE)
    if setting in MODULE:
        return _lookup(cfg.prefill_modules[0], setting)
    return _lookup(cfg if setting.startswith(("pool.", "limits.")) else cfg.decoders[0], setting)


def test_every_setting_has_one_row_and_a_probe():
    rows = table()
    assert set(rows) == settings_in_code()
    assert set(PROBES) == set(rows)
    assert all(rows.values()), [s for s, t in rows.items() if not t]


def _deployment(setting: str, over: dict) -> dict:
    dec = {"name": "lookup", "model": "checkpoints/decoders/lookup"}
    if setting.startswith("engine."):
        dec["engine"] = over
    elif setting.startswith("placement."):
        dec["placement"] = over
    else:  # a LoRA group setting: a decode group on the base
        dec = {"name": "group", "model": "checkpoints/base", "max_lora_rank": 16, **over,
               "adapters": [{"name": "ad", "path": "checkpoints/chat/adapters/lookup", "rank": 8}]}
    return dec


def _lookup(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def _arrived(setting: str, target: str, monkeypatch) -> list[Any]:
    """The values found at ``target`` once ``setting`` is probed (one per place that target names)."""
    from prefillshare.app.engine.pool.handover import PoolHandover
    from prefillshare.app.engine_args import engine_config, engine_env
    from prefillshare.deployments.application import engine_options

    over, _ = PROBES[setting]
    if setting in LIMITS:
        cfg = load_config({**BASE, "limits": over})
        assert target.startswith("EngineConfig."), f"{setting}: the table names {target!r}"
        return [getattr(engine_config(cfg, cfg.decoders[0].model, cfg.decoders[0].engine, cfg.decoders[0].placement,
                                      None), target.removeprefix("EngineConfig."))]
    if setting in MODULE:
        cfg = load_config({**BASE, "prefill_modules": [{**BASE["prefill_modules"][0], "max_lora_rank": 16, **over}]})
        p = cfg.prefill_modules[0]
        assert target.startswith("EngineConfig."), f"{setting}: the table names {target!r}"
        return [getattr(engine_config(cfg, p.model, p.engine, p.placement, None, p), target.removeprefix("EngineConfig."))]
    if setting.startswith("pool."):
        cfg = load_config({**BASE, "pool": over})
        assert target.startswith("PoolSpec."), f"{setting}: a pool setting goes to PoolSpec, not {target!r}"
        return [getattr(PoolHandover.from_config(cfg).pool, target.removeprefix("PoolSpec."))]
    cfg = load_config({**BASE, "decoders": [_deployment(setting, over)]})
    d = cfg.decoders[0]
    if target.startswith("AsyncEngineArgs."):
        args = engine_config(cfg, d.model, d.engine, d.placement, None, d).engine_args()
        name = target.removeprefix("AsyncEngineArgs.")
        if name == "*":
            return [{k: getattr(args, k) for k in over["engine_kwargs"]}]
        return [getattr(args, name)]
    if target.startswith("EngineConfig."):  # the project's own engine settings, applied by prefillshare.app.engine
        return [getattr(engine_config(cfg, d.model, d.engine, d.placement, None, d), target.removeprefix("EngineConfig."))]
    if target.startswith("env"):
        env = engine_env(cfg, d.placement, d.engine)
        var = target.removeprefix("env").strip()
        return [{k: env.get(k) for k in over["env"]}] if var == "*" else [env.get(var)]
    if target.startswith("Serve "):
        return [_lookup(engine_options(cfg, "x", d.placement, d.engine), target.removeprefix("Serve "))]
    raise AssertionError(f"{setting}: the table names {target!r}, a target this test does not know")


@pytest.mark.parametrize("setting", sorted(PROBES))
def test_each_row_names_where_the_setting_arrives(setting, monkeypatch):
    targets = table()[setting]
    _, want = PROBES[setting]
    for target in targets:
        found = _arrived(setting, target, monkeypatch)
        assert want in found, f"{setting} -> {target}: expected {want!r}, found {found!r}"


def test_a_row_naming_the_wrong_target_fails(monkeypatch):
    """The check above can fail: seed's value is not what max_num_seqs gets."""
    assert PROBES["engine.seed"][1] not in _arrived("engine.seed", "AsyncEngineArgs.max_num_seqs", monkeypatch)


@pytest.mark.parametrize("engine_kwargs, field", [
    ({"max_model_len": 64}, "decoders[0].engine.engine_kwargs.max_model_len: set it as decoders[0].engine.max_model_len"),
    ({"max_loras": 2}, "decoders[0].engine.engine_kwargs.max_loras: set by the app"),
    ({"no_such_argument": 1}, "decoders[0].engine.engine_kwargs.no_such_argument: not a vLLM engine argument"),
])
def test_engine_kwargs_are_checked_against_vllm_when_the_app_is_planned(engine_kwargs, field):
    from prefillshare.app.config import ConfigError
    from prefillshare.app.engine_args import check_engine_kwargs

    cfg = load_config({**BASE, "decoders": [{"name": "lookup", "model": "checkpoints/decoders/lookup",
                                             "engine": {"engine_kwargs": engine_kwargs}}]})
    with pytest.raises(ConfigError, match=re.escape(field)):
        check_engine_kwargs(cfg)


@pytest.mark.parametrize("section, old, new", [
    ("engine", "kv_cache_gib", "kv_cache_memory_bytes"),
    ("pool", "capacity_gib", "capacity_bytes"),
    ("pool", "fan_out_ttl_s", "lease_timeout_s"),
])
def test_a_renamed_setting_fails_naming_the_new_name(section, old, new):
    from prefillshare.app.config import ConfigError

    cfg = dict(BASE)
    if section == "engine":
        cfg["decoders"] = [{"name": "lookup", "model": "checkpoints/decoders/lookup", "engine": {old: 0.5}}]
        where = f"decoders[0].engine.{old}"
    else:
        cfg["pool"] = {old: 0.5}
        where = f"pool.{old}"
    with pytest.raises(ConfigError, match=re.escape(f"{where}: renamed to {new}")):
        load_config(cfg)


def test_an_engine_loads_the_models_own_tokenizer_only_when_it_is_the_apps(tmp_path):
    """engine_tokenizer: the model folder (whose config.json vLLM parses at once) when its
    tokenizer files equal the app's byte for byte, else the app's tokenizer folder."""
    import shutil

    from prefillshare.app.engine_args import engine_tokenizer

    tok, model = tmp_path / "tok", tmp_path / "model"
    shutil.copytree(ROOT / "checkpoints" / "tokenizer", tok)
    shutil.copytree(ROOT / "checkpoints" / "tokenizer", model)
    (model / "config.json").write_text("{}")
    cfg = load_config({**BASE, "tokenizer": str(tok)})
    assert engine_tokenizer(cfg, str(model)) == str(model)
    (model / "tokenizer_config.json").write_text((tok / "tokenizer_config.json").read_text() + " ")
    assert engine_tokenizer(cfg, str(model)) == str(tok)  # one byte differs: the app's own
    (model / "tokenizer_config.json").unlink()
    assert engine_tokenizer(cfg, str(model)) == str(tok)


def _size(v: Any) -> Any:
    from prefillshare.app.config import _bytes

    return _bytes(v) if isinstance(v, str) and v[-1:] == "B" and v[:1].isdigit() else v


@pytest.mark.parametrize("setting", sorted(PROBES))
def test_each_row_states_the_settings_default(setting):
    assert _size(documented_defaults()[setting]) == configured_default(setting), setting


def _library_fields() -> dict[str, Any]:
    """Defaults of the lower layers' fields, by the table's target name."""
    import dataclasses
    import inspect

    from prefillshare.app.engine.async_engine import EngineConfig
    from prefillshare.app.engine.pool.kv_pool import PoolSpec
    from prefillshare.deployments.routing.node_router import NodeAffinityRouter
    from prefillshare.deployments.routing.prefix_router import LocalityTable, PrefixLocalityRouter

    out = {f"EngineConfig.{f.name}": f.default for f in dataclasses.fields(EngineConfig)
           if f.default is not dataclasses.MISSING}
    out |= {f"PoolSpec.{f.name}": f.default for f in dataclasses.fields(PoolSpec) if f.default is not dataclasses.MISSING}
    for name, fn in [("PrefixLocalityRouter", PrefixLocalityRouter.initialize_state),
                     ("NodeAffinityRouter", NodeAffinityRouter.initialize_state),
                     ("LocalityTable", LocalityTable.__init__)]:
        out |= {f"{name}.{p.name}": p.default for p in inspect.signature(fn).parameters.values()
                if p.default is not inspect.Parameter.empty}
    return out


@pytest.mark.parametrize("setting", sorted(PROBES))
def test_engines_and_pools_built_without_a_config_take_the_configs_default(setting):
    """EngineConfig and PoolSpec read their defaults from app/config.py: one value, written once."""
    lib = _library_fields()
    field = setting.rsplit(".", 1)[-1]
    own = [t for t in table()[setting] if t.split(".")[0] in ("AsyncEngineArgs", "EngineConfig", "PoolSpec")]
    places = {f"EngineConfig.{t.split('.', 1)[1]}" if t.startswith("AsyncEngineArgs.") else t for t in own}
    for place in sorted(p for p in places if p in lib and p.rsplit(".", 1)[-1] == field):
        assert lib[place] == configured_default(setting), f"{place} defaults to {lib[place]!r}, {setting} to " \
                                                          f"{configured_default(setting)!r}"


def test_the_request_routers_take_the_routing_defaults():
    from prefillshare.app.config import RoutingConfig, default

    lib = _library_fields()
    assert lib["PrefixLocalityRouter.imbalance_threshold"] == lib["NodeAffinityRouter.imbalance_threshold"] \
        == default(RoutingConfig, "imbalance_threshold")
    assert lib["PrefixLocalityRouter.max_tracked_prefixes"] == lib["LocalityTable.capacity"] \
        == default(RoutingConfig, "max_tracked_prefixes")


def test_vllms_legacy_kv_space_env_is_neither_set_by_the_suite_nor_seen_by_an_engine(tmp_path, monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes; engines drop it from their env."""
    import os

    from prefillshare.app.engine.async_engine import EngineConfig, _engine_env

    assert "VLLM_CPU_KVCACHE_SPACE" not in (ROOT / "scripts" / "test.sh").read_text()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    with _engine_env(EngineConfig(model=str(tmp_path))):
        assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "4"
