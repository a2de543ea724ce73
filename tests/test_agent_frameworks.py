"""Agents as users define them share one prefill: each agent's own system prompt, sent first by
agent frameworks, over one shared conversation.

Three decoders are trained through the CLI on chat data with a system prompt each (shared-first,
the default layout) and served together on the shipped base: one full decoder and two LoRA
adapters of one decode group. Two chat completions with their agents' system prompts, then an
unmodified LangGraph graph of three ``create_react_agent`` agents in parallel branches through
``langchain-openai``'s ``ChatOpenAI``: the base's computed prompt tokens on /metrics show the
shared conversation computed once, not once per agent.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_test_app import _metric, _metrics

from bench.random_models import serve_app

ROOT = Path(__file__).resolve().parent.parent
AGENTS = {  # served name -> the agent's own system prompt
    "city-agent": "You find the city of an order. Answer with the city alone.",
    "count-agent": "You count the items of an order. Answer with the quantity alone.",
    "route-agent": "You pick the hub that ships an order to its city. Answer with the hub alone.",
}
ENGINE = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": "128MiB", "block_size": 32,
          "max_num_seqs": 8, "threads_bind": "nobind"}
PLACE = {"num_cpus": 0.25, "placement_group_bundles": [{"CPU": 0.25}]}
pytestmark = [pytest.mark.serve, pytest.mark.engine]


def _context(seed: int, records: int = 12) -> str:
    """A shared conversation of ~350 tokens: order records one after another."""
    from prefillshare.app.training import tasks

    return "\n".join(e.context for e in tasks.make_examples(records, seed=seed)[::4])


def _train(tmp: Path) -> dict[str, Path]:
    """One CLI run per agent (2 steps: sharing, not accuracy, is under test): merged + adapter."""
    from prefillshare.app.training import recipe, tasks

    template = tmp / "template.jinja"
    template.write_text(recipe.CHAT_TEMPLATE)
    rows = [{"agent": name, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": e.context},
                                         {"role": "assistant", "content": e.answer}]}
            for name, system in AGENTS.items() for e in tasks.make_examples(8, seed=11)[:8]]
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = {}
    for name in AGENTS:
        subprocess.run([sys.executable, "-m", "prefillshare.app.cli", "train", "--base", str(ROOT / "checkpoints" / "base"),
                        "--data", str(data), "--agent", name, "--chat-template", str(template), "--lora",
                        "--lora-rank", "4", "--steps", "2", "--batch-size", "4", "--no-progress",
                        "--out", str(tmp / name)], check=True, cwd=ROOT, timeout=600)
        out[name], out[f"{name}-adapter"] = tmp / name, tmp / f"{name}-adapter"
    return out


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    from prefillshare.app.config import load_config

    tmp = tmp_path_factory.mktemp("frameworks")
    paths = _train(tmp)
    pool = f"/dev/shm/ps-frameworks-{os.getpid()}"
    cfg = load_config({
        "tokenizer": str(ROOT / "checkpoints" / "tokenizer"),
        "pool": {"path": pool, "capacity_bytes": "128MiB"},
        "limits": {"max_tokens_default": 4, "max_tokens_cap": 16},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "sharing": {"require": True},  # the build itself checks that every decoder shares
        "prefill_modules": [{"name": "base", "model": str(ROOT / "checkpoints" / "base"), "engine": ENGINE,
                             "placement": {"num_replicas": 1, "num_cpus": 0.5}}],
        "decoders": [
            {"name": "city-agent", "model": str(paths["city-agent"]), "engine": ENGINE, "placement": PLACE},
            {"name": "agents", "model": str(ROOT / "checkpoints" / "base"), "engine": ENGINE, "placement": PLACE,
             "max_lora_rank": 8, "adapters": [{"name": n, "path": str(paths[f"{n}-adapter"]), "rank": 4}
                                              for n in ("count-agent", "route-agent")]},
        ],
    })
    with serve_app(cfg, "ps-frameworks", f"/tmp/rfw{os.getpid()}", pool) as url:
        yield url


def _base_computed(url: str) -> float:
    """Prompt tokens the base has computed (prefix-cache hits excluded), from /metrics."""
    return _metric(_metrics(url), "prefillshare_prefill_tokens_computed_total", module="base", stage="prefill")


def _vllm_base_computed(url: str) -> float:
    """The same from vLLM's own counters of the base's engine (prompt tokens looked up in its prefix
    cache, less those found), which its replica pushes to /metrics: an independent count."""
    m = _metrics(url)
    return (_metric(m, "vllm:prefix_cache_queries_total", model_name="base")
            - _metric(m, "vllm:prefix_cache_hits_total", model_name="base"))


def _settled(url: str, before: float, read=_base_computed) -> float:
    """``read``'s tokens since ``before``, once the replicas' batched metrics have arrived."""
    import time

    last, deadline = None, time.monotonic() + 20
    while time.monotonic() < deadline:  # metrics are sent in batches; wait until two reads agree
        now = read(url) - before
        if now == last and now > 0:
            return now
        last = now
        time.sleep(1.5)
    return last or 0.0


def _fallbacks(url: str) -> float:
    """Requests that prefilled on their decoder instead of reading the base's KV, from /metrics."""
    return _metric(_metrics(url), "prefillshare_fallbacks_total")


def test_the_status_route_reports_every_decoder_sharing(app_url):
    report = httpx.get(f"{app_url}/sharing", timeout=30).json()
    assert report["sharing"] is True
    (module,) = report["modules"]
    assert sorted(d["decoder"] for d in module["decoders"]) == sorted(AGENTS)
    assert all(d["layout"] == "shared_first" and d["shares"] for d in module["decoders"])


def test_two_agents_with_their_own_system_prompts_share_one_prefill(app_url):
    """One full decoder and one LoRA adapter, each with its agent's system prompt, over one context."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=120)
    context = _context(seed=21)
    before, fallbacks = _base_computed(app_url), _fallbacks(app_url)
    usage, loaded = [], []
    for name in ("city-agent", "count-agent"):
        r = client.chat.completions.create(model=name, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": AGENTS[name]}, {"role": "user", "content": context}])
        usage.append(r.usage.prompt_tokens)
        loaded.append(r.usage.prompt_tokens_details.cached_tokens)
    assert min(usage) > 300  # a ~350-token shared context plus each agent's own text
    computed = _settled(app_url, before)
    print(f"base computed {computed:.0f} prompt tokens for prompts of {usage} ({computed / max(usage):.2f}x one); "
          f"decoders loaded {loaded}")
    # the new context computed once on the base (a missing metric reads 0 and fails), not once per agent
    assert 0.8 * min(usage) <= computed <= 1.3 * max(usage)
    # each decoder read the base's KV for its prompt (all but the last token), none prefilled itself
    assert all(n >= 0.8 * u for n, u in zip(loaded, usage)), (loaded, usage)
    assert _fallbacks(app_url) == fallbacks


def test_an_unmodified_langgraph_graph_of_parallel_react_agents_shares_the_conversation(app_url):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import create_react_agent

    graph = StateGraph(MessagesState)
    for name, system in AGENTS.items():
        llm = ChatOpenAI(model=name, base_url=f"{app_url}/v1", api_key="unused", max_tokens=2, temperature=0,
                         max_retries=0, timeout=120)
        graph.add_node(name, create_react_agent(llm, tools=[], prompt=system, name=name))
        graph.add_edge(START, name)  # every agent reads the same conversation, in parallel branches
        graph.add_edge(name, END)
    context = _context(seed=33)
    before, fallbacks, vllm_before = _base_computed(app_url), _fallbacks(app_url), _vllm_base_computed(app_url)
    state = graph.compile().invoke({"messages": [HumanMessage(context)]})
    answers = [m for m in state["messages"] if m.type == "ai"]
    assert sorted(m.name for m in answers) == sorted(AGENTS)  # each agent answered through the app
    prompts = [m.usage_metadata["input_tokens"] for m in answers]
    # langchain-openai reads the OpenAI usage's cached_tokens: the tokens each decoder took from the base
    loaded = [m.usage_metadata["input_token_details"]["cache_read"] for m in answers]
    computed = _settled(app_url, before)
    print(f"LangGraph, {len(AGENTS)} agents: base computed {computed:.0f} prompt tokens for prompts of {prompts} "
          f"({computed / max(prompts):.2f}x one; {sum(prompts)} without sharing); decoders loaded {loaded}")
    # the shared conversation once, each agent's own text after it: far below once per agent
    assert 0.8 * min(prompts) <= computed <= 1.5 * max(prompts)
    assert all(n >= 0.8 * p for n, p in zip(loaded, prompts)), (loaded, prompts)
    assert _fallbacks(app_url) == fallbacks
    by_vllm = _settled(app_url, vllm_before, _vllm_base_computed)  # vLLM's own count agrees with the app's
    assert abs(by_vllm - computed) <= 0.1 * computed + 32, (by_vllm, computed)
