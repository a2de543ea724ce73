"""AppConfig validation, serve_config.yaml, and the pure parts of the Serve app (no Ray cluster)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prefillshare.app.config import AppConfig, ConfigError, load_config
from prefillshare.deployments.prompts import common_prefix
from prefillshare.deployments.routing.locality import locality_keys
from prefillshare.deployments.routing.prefix_router import LocalityTable, choose, rendezvous_rank

ROOT = Path(__file__).resolve().parent.parent


def minimal(**over) -> dict:
    cfg = {
        "prefill_modules": [{"name": "base", "model": "checkpoints/base"}],
        "decoders": [{"name": "lookup", "model": "checkpoints/decoders/lookup"}],
    }
    cfg.update(over)
    return cfg


def test_minimal_config_gets_defaults():
    cfg = load_config(minimal())
    assert cfg.prefill_modules[0].placement.num_replicas == 1
    assert cfg.decoders[0].prefill_module == "auto"
    assert cfg.decoders[0].placement.placement_group_bundles == [{"CPU": 0.25}]
    assert cfg.path("checkpoints/base") == ROOT / "checkpoints" / "base"


@pytest.mark.parametrize("mutate, field", [
    (lambda c: c["decoders"].append(dict(c["decoders"][0])), "decoders"),
    (lambda c: c["prefill_modules"].append(dict(c["prefill_modules"][0])), "prefill_modules"),
    (lambda c: c["decoders"][0].update(prefill_module="nope"), "decoders[0].prefill_module"),
    (lambda c: c["decoders"][0].update(name="bad name!"), "decoders[0].name"),
    (lambda c: c["prefill_modules"][0].update(placement={"num_replicas": 0}), "prefill_modules[0].placement.num_replicas"),
    (lambda c: c["decoders"][0].update(engine={"threads_bind": "all"}), "decoders[0].engine.threads_bind"),
    (lambda c: c["decoders"][0].update(engine={"kv_cache_memory_bytes": -1}), "decoders[0].engine.kv_cache_memory_bytes"),
    (lambda c: c["decoders"][0].update(placement={"num_cpus": 1, "placement_group_bundles": [{"CPU": 0.5}]}),
     "placement_group_bundles[0]"),
    (lambda c: c.update(decoders=[]), "decoders"),
    (lambda c: c.update(unknown_key=1), "unknown_key"),
    (lambda c: c["pool"].update(lease_timeout_s=0), "pool.lease_timeout_s"),
])
def test_bad_config_names_the_field(mutate, field):
    cfg = minimal(pool={})
    mutate(cfg)
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert field in str(e.value)


@pytest.mark.parametrize("field", ["transport", "nixl_peers", "nixl_listen", "nixl_timeout_s", "server_resources",
                                   "decode_path"])
def test_a_setting_of_the_retired_block_server_says_what_replaces_it(field):
    with pytest.raises(ConfigError) as e:
        load_config(minimal(pool={field: "nixl"}))
    assert f"pool.{field}" in str(e.value) or field in str(e.value)
    assert "removed" in str(e.value) and "handover: vllm-nixl" in str(e.value)


def test_prefill_wait_reaches_the_plan_and_must_be_positive():
    from prefillshare.app.plan import plan_app

    plan = plan_app(load_config(minimal(limits={"prefill_wait_s": 1.5})))
    assert plan.limits.prefill_wait_s == 1.5
    with pytest.raises(ConfigError, match="limits.prefill_wait_s"):
        load_config(minimal(limits={"prefill_wait_s": 0}))


def test_engine_settings_reach_the_engine_config_gpu_fraction_included():
    from prefillshare.app.engine_args import engine_config

    cfg = load_config(minimal(decoders=[{"name": "lookup", "model": "checkpoints/decoders/lookup",
                                         "engine": {"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": "0.5GiB"}}]))
    d = cfg.decoders[0]
    ec = engine_config(cfg, d.model, d.engine, d.placement, None)
    assert ec.gpu_memory_utilization == 0.2 and ec.kv_cache_memory_bytes == 1 << 29
    assert ec.engine_args().gpu_memory_utilization == 0.2


def test_missing_checkpoint_is_named(tmp_path):
    cfg = load_config(minimal(root=str(tmp_path), tokenizer=str(ROOT / "checkpoints" / "tokenizer")))
    with pytest.raises(ConfigError, match=r"prefill_modules\[0\]\.model"):
        cfg.check_paths()


def test_serve_config_yaml_is_valid_for_serve_and_for_the_app():
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    assert raw["http_options"]["host"] == "127.0.0.1"
    app = raw["applications"][0]
    assert app["import_path"] == "prefillshare.deployments.application:build_app"
    cfg = load_config(ROOT / "serve_config.yaml")
    assert isinstance(cfg, AppConfig)
    assert cfg.prefill_modules[0].placement.num_replicas == 1
    assert len(cfg.decoders) >= 3
    engines = sum(p.placement.num_replicas for p in cfg.prefill_modules) + sum(
        d.placement.num_replicas for d in cfg.decoders)
    # ~1.2 GiB per engine beyond its KV space (docs/platform.md), 1.35 with a margin: keep the default app small.
    gib = sum((1.35 + p.engine.kv_cache_memory_bytes / (1 << 30)) * p.placement.num_replicas for p in cfg.prefill_modules) + sum(
        (1.35 + d.engine.kv_cache_memory_bytes / (1 << 30)) * d.placement.num_replicas for d in cfg.decoders)
    assert engines >= 4 and gib < 10
    logical_cpus = sum(p.placement.num_cpus * p.placement.num_replicas for p in cfg.prefill_modules) + sum(
        d.placement.num_cpus * d.placement.num_replicas for d in cfg.decoders)
    assert logical_cpus + cfg.router.num_cpus + cfg.orchestrator.num_cpus + cfg.metrics.num_cpus <= 2


def test_the_commented_lora_group_in_serve_config_yaml_plans_as_written():
    """The chat-format decode group that serve_config.yaml documents (commented out) is valid as
    written: uncommented in place of the base's lora_decoders, the app plans it with the shipped
    adapters (manifests, ranks, base), no engine."""
    from prefillshare.app.plan import plan_app

    lines = (ROOT / "serve_config.yaml").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.strip() == "# - name: chat-group")
    indent = lines[start].index("#")
    out = list(lines)
    for i in range(start, len(lines)):
        if not lines[i].strip().startswith("#") or lines[i].index("#") != indent:
            break
        out[i] = lines[i][:indent] + lines[i][indent + 2:]
    raw = yaml.safe_load("\n".join(out))
    config = raw["applications"][0]["args"]["config"]
    for p in config["prefill_modules"]:  # the group serves what the base's lora_decoders serve: one or the other
        p.pop("lora_decoders", None)
    cfg = load_config(config)
    plan = plan_app(cfg)
    group = [d for d in plan.decoders if d.group == "chat-group"]
    assert [d.name for d in group] == ["chat-lookup", "chat-tool_call", "chat-reschedule", "chat-route"]
    assert all(d.adapter == d.name and d.prefill_module == "base" for d in group)


def test_cpu_engines_run_their_worker_inside_enginecore_unless_threads_are_pinned_or_on_gpu():
    from prefillshare.app.config import EngineSettings, Placement
    from prefillshare.app.engine_args import engine_env

    cfg = load_config(minimal())
    flag = "VLLM_ENABLE_V1_MULTIPROCESSING"
    assert engine_env(cfg, Placement(), EngineSettings())[flag] == "0"
    assert flag not in engine_env(cfg, Placement(), EngineSettings(threads_bind="0-1"))
    assert flag not in engine_env(cfg, Placement(num_gpus=1), EngineSettings())


def test_pinned_threads_beyond_a_replicas_cpus_are_warned_about_naming_the_field_and_the_fix(caplog):
    from prefillshare.app.engine_args import bound_cores, oversubscribed_threads
    from prefillshare.app.plan import plan_app

    assert [bound_cores(b) for b in ("nobind", "0", "0-1", "0,2-3", "0-1|2-3")] == [None, 1, 2, 3, 2]
    assert oversubscribed_threads(load_config(minimal())) == []  # nobind: threads follow num_cpus
    cfg = load_config(minimal(decoders=[{"name": "lookup", "model": "checkpoints/decoders/lookup",
                                         "engine": {"threads_bind": "0-1"}, "placement": {"num_cpus": 0.5}}]))
    (line,) = oversubscribed_threads(cfg)
    assert line.startswith("decoders[0].engine.threads_bind: '0-1' runs 2 OpenMP threads")
    assert "decoders[0].placement.num_cpus=0.5" in line and "threads_bind: nobind" in line
    ok = minimal(decoders=[{"name": "lookup", "model": "checkpoints/decoders/lookup",
                            "engine": {"threads_bind": "0-1"}, "placement": {"num_cpus": 2}}])
    assert oversubscribed_threads(load_config(ok)) == []  # the replica reserves what it pins
    with caplog.at_level("WARNING", logger="ray.serve"):
        plan_app(cfg)
    assert line in caplog.text  # said when the app is built


# --- prefix-locality policy ----------------------------------------------------------------
def test_rendezvous_is_stable_and_spreads_keys():
    ids = ["r1", "r2", "r3"]
    assert rendezvous_rank("k", ids)[0] == rendezvous_rank("k", list(reversed(ids)))[0]
    firsts = {rendezvous_rank(f"key{i}", ids)[0] for i in range(64)}
    assert firsts == set(ids)


def test_same_context_goes_to_one_replica_across_routers():
    ids = ["a", "b"]
    ctx = list(range(100, 164))  # 4 blocks of 16
    keys_x = locality_keys("pm-1", ctx + [1, 2, 3], 16)
    keys_y = locality_keys("pm-1", ctx + [7, 8, 9, 10, 11], 16)
    t1, t2 = LocalityTable(), LocalityTable()  # two callers, no shared state
    (first1, *_), reason1 = choose(keys_x, ids, lambda r: 0, t1, 4)
    (first2, *_), reason2 = choose(keys_y, ids, lambda r: 0, t2, 4)
    assert reason1 is reason2 is None
    assert first1 == first2 and len(first1) == 1


def test_longest_known_prefix_wins_then_overload_falls_back():
    table = LocalityTable()
    keys = locality_keys("pm-1", list(range(64)), 16)
    other = "b" if rendezvous_rank(keys[0], ["a", "b"])[0] == "a" else "a"
    table.record(keys, other)  # this router saw the context served by `other`
    tiers, reason = choose(keys, ["a", "b"], lambda r: 0, table, 4)
    assert tiers[0] == [other] and reason is None
    least = "a" if other == "b" else "b"
    # the replica holding the whole prompt's blocks carries up to 4x the threshold more than the least loaded
    tiers, reason = choose(keys, ["a", "b"], {other: 9, least: 1}.get, table, 4)
    assert tiers[0] == [other] and reason is None
    tiers, reason = choose(keys, ["a", "b"], {other: 17, least: 1}.get, table, 4)
    assert reason == "prefill_overloaded" and tiers[0][0] != other
    # holding a minority of the blocks (one of four), it carries the threshold only
    fresh = LocalityTable()
    fresh.record(keys[:1], other)
    tiers, reason = choose(keys, ["a", "b"], {other: 5, least: 1}.get, fresh, 4)
    assert reason == "prefill_overloaded" and tiers[0][0] == least


def test_keys_depend_on_module_and_tokens():
    a = locality_keys("pm-1", list(range(40)), 16)
    assert len(a) == 2  # only full blocks
    assert locality_keys("pm-2", list(range(40)), 16) != a
    assert locality_keys("pm-1", list(range(40)), 16, "tenant") != a
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
