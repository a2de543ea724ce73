"""The plan is built once: each served decoder's manifest is read once, each rendering checked once,
and the replicas that receive the plan (Router, Orchestrator) do neither again."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from prefillshare.app.config import load_config
from prefillshare.app.rendering import Renderer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def shipped_with_group():
    """The shipped decoders plus the chat adapters as a decode group (manifests with chat templates)."""
    adapters = [{"name": f"chat-{a}", "path": f"checkpoints/chat/adapters/{a}", "rank": 8}
                for a in ("lookup", "tool_call", "reschedule", "route")]
    return load_config({
        "prefill_modules": [{"name": "base", "model": "checkpoints/base"}],
        "decoders": [{"name": n, "model": f"checkpoints/decoders/{n}"} for n in ("lookup", "tool_call")]
        + [{"name": "chat-group", "model": "checkpoints/base", "max_lora_rank": 8, "adapters": adapters}],
    })


def test_each_manifest_is_read_once_and_each_rendering_checked_once(shipped_with_group, monkeypatch):
    from prefillshare.app.models import compat, manifest
    from prefillshare.app.plan import plan_app
    from prefillshare.deployments.prompts import Prompter

    reads: Counter[str] = Counter()
    real = manifest.read_manifest

    def counting(directory):
        reads[str(Path(directory).resolve())] += 1
        return real(directory)

    monkeypatch.setattr(manifest, "read_manifest", counting)
    monkeypatch.setattr(compat, "read_manifest", counting)
    monkeypatch.setattr("prefillshare.app.rendering.read_manifest", counting)
    checks: Counter[str] = Counter()
    real_check = Renderer.check

    def counting_check(self, tok, where):
        checks[where] += 1
        return real_check(self, tok, where)

    monkeypatch.setattr(Renderer, "check", counting_check)
    plan = plan_app(shipped_with_group)
    served = [d.name for d in plan.decoders]
    assert served == ["lookup", "tool_call", "chat-lookup", "chat-tool_call", "chat-reschedule", "chat-route"]
    assert len(reads) == len(served) and set(reads.values()) == {1}, reads
    # each chat template is checked once against the tokenizer; the suite format needs no check
    templated = [d.name for d in plan.decoders if d.renderer.format == "chat_template"]
    assert templated == ["chat-lookup", "chat-tool_call", "chat-reschedule", "chat-route"]  # the adapters' format
    assert len(checks) == len(templated) and set(checks.values()) == {1}, checks
    # a replica builds its Prompter from the plan: no manifest read, no check
    before = (sum(reads.values()), sum(checks.values()))
    p = Prompter(plan.tokenizer, plan.renderers)
    assert (sum(reads.values()), sum(checks.values())) == before
    assert p.renderer("chat-route") is plan.decoder("chat-route").renderer


def test_the_plan_carries_the_limits_once(shipped_with_group):
    from prefillshare.app.plan import AppPlan, plan_app

    plan = plan_app(shipped_with_group)
    assert plan.limits is shipped_with_group.limits
    assert not {"max_tokens_default", "max_tokens_cap", "request_timeout_s", "max_agents"} & set(AppPlan.__dataclass_fields__)


def test_the_shipped_app_binds_without_a_cluster():
    """serve_config.yaml's app goes through the plan and binds every deployment (no engine starts)."""
    from ray.serve import Application

    from prefillshare.deployments.application import build

    app = build(load_config(ROOT / "serve_config.yaml"))
    assert isinstance(app, Application)
    # admission holds its bound while one of these runs short: every engine deployment the Router
    # calls, under the name Serve gives it, with the bounds of its replica count Serve was given
    router = app._bound_deployment
    bounds = router.init_args[6]
    called = {a._bound_deployment.name: a._bound_deployment for a in
              [*router.init_args[2].values(), *router.init_args[3].values()]}
    assert set(bounds) == set(called) | {"Router", "Orchestrator"}
    assert {n for n, b in bounds.items() if b.engine} == set(called)
    for name, dep in called.items():
        auto = dep._deployment_config.autoscaling_config
        if auto is None:
            assert bounds[name].min_replicas == bounds[name].max_replicas == dep.num_replicas
        else:
            assert (bounds[name].min_replicas, bounds[name].max_replicas) == (auto.min_replicas, auto.max_replicas)
    assert any(b.autoscaled for b in bounds.values())
