"""Sharing checked at deploy time and visible on /metrics: a decoder trained system-first is named
(or fails the build with sharing.require); the prefill modules' sharing factor is counted."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from prefillshare.app.config import ConfigError, load_config
from prefillshare.app.models.manifest import MANIFEST_NAME
from prefillshare.app.sharing import fanout_cost, prefix_tree_tokens
from prefillshare.deployments.messages import PrefillRecord
from prefillshare.deployments.metrics import AppMetrics

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "checkpoints" / "chat" / "adapters" / "lookup"


def _adapter(tmp: Path, name: str, layout: str) -> Path:
    """A shipped chat adapter whose manifest records ``layout`` (weights and template unchanged)."""
    d = tmp / name
    shutil.copytree(ADAPTER, d)
    data = json.loads((d / MANIFEST_NAME).read_text())
    data["prompt"]["layout"] = layout
    (d / MANIFEST_NAME).write_text(json.dumps(data))
    return d


def _config(tmp: Path, layouts: dict[str, str], require: bool = False):
    adapters = [{"name": n, "path": str(_adapter(tmp, n, layout)), "rank": 8} for n, layout in layouts.items()]
    return load_config({"prefill_modules": [{"name": "base", "model": str(ROOT / "checkpoints" / "base")}],
                        "decoders": [{"name": "group", "model": str(ROOT / "checkpoints" / "base"), "max_lora_rank": 8,
                                      "adapters": adapters}],
                        "sharing": {"require": require}})


def test_the_plan_names_a_system_first_decoder_and_counts_what_a_fanout_costs(tmp_path, caplog):
    from prefillshare.app.plan import plan_app

    caplog.set_level(logging.INFO, logger="ray.serve")
    plan = plan_app(_config(tmp_path, {"a": "shared_first", "b": "shared_first", "old": "system_first"}))
    (report,) = plan.sharing
    verdict = {d.decoder: d.shares for d in report.decoders}
    assert verdict == {"a": True, "b": True, "old": False}
    old = next(d for d in report.decoders if d.decoder == "old")
    assert old.shared_tokens < old.context_tokens / 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("decoders[0].adapters[2]: decoder old (layout system_first)") and "--layout shared-first"
               in m for m in warned), warned
    shared_only = plan_app(_config(tmp_path / "2", {"a": "shared_first", "b": "shared_first", "c": "shared_first"}))
    # three agents with their own system prompts: the context once, each agent's own text after it
    assert shared_only.sharing[0].ratio < report.ratio
    assert shared_only.sharing[0].ratio < 2.0 and report.ratio > 2.0
    assert all(d["shares"] and d["problem"] is None for d in shared_only.sharing[0].to_dict()["decoders"])


def test_the_default_app_shares_a_framework_shaped_fanout():
    """serve_config.yaml: every decoder (the full-weight suite decoders and the in-engine chat
    adapters) renders an agent's own system prompt after the shared context, so GET /sharing on
    `make serve` answers true; one probe fan-out costs the base well under one prompt per agent."""
    from prefillshare.app.plan import plan_app

    plan = plan_app(load_config(ROOT / "serve_config.yaml"))
    (report,) = plan.sharing
    verdict = {d.decoder: d.shares for d in report.decoders}
    assert set(verdict) >= {"lookup", "tool_call", "reschedule", "route", "chat-lookup", "chat-route"}, verdict
    assert all(verdict.values()), verdict
    assert report.ratio < len(verdict) / 2, report.to_dict()


def test_sharing_require_fails_the_build_naming_the_decoder(tmp_path):
    from prefillshare.app.plan import plan_app

    with pytest.raises(ConfigError, match=r"decoders\[0\]\.adapters\[1\]: decoder old .*sharing.require is on"):
        plan_app(_config(tmp_path, {"a": "shared_first", "old": "system_first"}, require=True))
    assert plan_app(_config(tmp_path / "ok", {"a": "shared_first", "b": "shared_first"}, require=True)).sharing


def test_prefix_tree_tokens_counts_each_shared_prefix_once():
    assert prefix_tree_tokens([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]]) == 6  # 1 2 3 4 5 6
    assert prefix_tree_tokens([[1, 2], [3, 4]]) == 4
    assert prefix_tree_tokens([[1, 2, 3], [1, 2, 3]]) == 3
    # a fan-out hands over each prompt but its last token: 1 2 3 once, then 5 and 6 / 7
    assert fanout_cost([[1, 2, 3, 5, 9], [1, 2, 3, 6, 7, 9]]) == (6, 4.5)


def _value(metrics: AppMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_the_sharing_factor_per_module_and_per_call():
    m = AppMetrics()
    # a fan-out to 4 decoders over a 100-token context: 4 x 110 tokens handed over, 140 computed
    m.prefill(PrefillRecord("base", "r1", computed_tokens=140, cached_tokens=400, seconds=0.1,
                            handed_over_tokens=440))
    assert _value(m, "prefillshare_prefill_handed_over_tokens_total", module="base") == 440
    assert _value(m, "prefillshare_prefill_sharing_factor", module="base") == pytest.approx(440 / 140)
    # then a prompt that shares nothing: the module's factor falls, the call's own is 1
    m.prefill(PrefillRecord("base", "r1", computed_tokens=200, cached_tokens=0, seconds=0.1, handed_over_tokens=200))
    assert _value(m, "prefillshare_prefill_sharing_factor", module="base") == pytest.approx(640 / 340)
    assert _value(m, "prefillshare_prefill_call_sharing_factor_bucket", module="base", le="1.0") == 1
    assert _value(m, "prefillshare_prefill_call_sharing_factor_count", module="base") == 2
