"""The three systems the serving benchmark compares, each an ordinary AppConfig.

All three are the same Serve application (Router -> Orchestrator -> engines) behind the same
HTTP routes with decoders named ``agent0..agent{n-1}``; only the topology differs:

  a  prefillshare   one shared prefill module (frozen base, ``prefill_replicas`` replicas)
                    + n decoders loading its KV through the connector;
  b  disagg         per-model P/D: decoder i's prompts are prefilled by a prefill module on
                    decoder i's own model (n prefill modules, one per decoder), KV handed
                    over through the same connector; nothing is shared across models;
  c  colocated      n engines that prefill and decode their own prompts, prefix caching on,
                    no prefill module and no connector.

The same three with the n decoders as LoRA adapters of the base (random-weight adapters):

  a-lora            the shared prefill module + ONE decode group holding the n adapters, loading
                    the base's KV for every adapter's request;
  b-lora            per-model P/D with adapters: one prefill engine holding the n adapters
                    (each adapter computes its own prompt's KV, keyed per adapter) handing KV to
                    one decode group holding the same n adapters;
  c-lora            what vLLM users run today: engines holding the n adapters, prefix caching on,
                    each adapter prefilling its own prompt (vLLM salts cached blocks per adapter);
                    ``colocated_replicas`` replicas so that it uses every core, like a and b.

And the n adapters served in the base's own engine (in-engine LoRA decoders, app/engine/vllm_plugin.py):

  i-lora            the prefill module's engine holds the n adapters as ``lora_decoders``: each
                    adapter's request reads the base's prefix cache up to the hand-over point and runs
                    its adapter from there; no decode group, no KV copy. One engine by default, given
                    every core (``in_engine_replicas``), as v-one's stock server uses them.

And a-lora again with chat decoders, for ``--driver chat`` (agents with their own system prompts
and tools, each sent as a framework sends it: ``[system, user: the shared context]``): the same
adapters declaring a chat template and JSON tool calls, laid out

  a-sf-lora         shared-first (the agent's system prompt and tools after the shared context:
                    the N agents' prompts share the context, which the base prefills once);
  a-sys-lora        system-first (the messages as sent: every agent's prompt starts with its own
                    text, so the base prefills the context once per agent).

And two stock vLLM OpenAI servers (bench/stock_vllm.py; only with vLLM's client as the
driver, since they have no ``/v1/agents/run``): ``v-lora``, one server holding the n adapters
with prefix caching, and ``v-one``, one model answering every decoder's name (the bound on sharing).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from bench.models import ModelSet

SYSTEMS = {"a": "prefillshare", "b": "disagg", "c": "colocated",
           "a-lora": "prefillshare-lora", "b-lora": "disagg-lora", "c-lora": "multi-lora",
           "i-lora": "prefillshare-in-engine-lora",
           "a-sf-lora": "prefillshare-lora-shared-first", "a-sys-lora": "prefillshare-lora-system-first",
           "v-lora": "vllm-multi-lora", "v-one": "vllm-one-model"}
# the systems --driver chat can send tools to: chat decoders declaring a tool-call format, stock servers
CHAT_SYSTEMS = ("a-sf-lora", "a-sys-lora", "v-lora", "v-one")
# (system under test, baseline) pairs the report compares
PAIRS = (("a", "b"), ("a", "c"), ("i-lora", "a-lora"), ("i-lora", "v-lora"), ("i-lora", "v-one"), ("a-lora", "b-lora"), ("a-lora", "c-lora"), ("a-lora", "v-lora"),
         ("a-lora", "v-one"), ("c-lora", "v-lora"), ("a-sf-lora", "a-sys-lora"), ("a-sf-lora", "v-lora"),
         ("a-sys-lora", "v-lora"))


@dataclass(frozen=True)
class Topology:
    """Engine and placement knobs shared by every system of a run (fair comparison)."""

    kv_cache_gib: float = 0.25
    max_model_len: int = 2048
    block_size: int = 32
    max_num_seqs: int = 16
    threads_bind: str = "nobind"
    dtype: str = "auto"
    prefill_replicas: int = 2      # system a: one shared prefill replica per core
    pool_gib: float = 0.5
    max_tokens_cap: int = 256
    max_agents: int = 16
    max_rounds: int = 4
    request_timeout_s: float = 600.0
    lora_rank: int = 16
    lora_kv_cache_gib: float | None = None  # KV space of an engine holding n adapters (default n x kv_cache_gib)
    colocated_replicas: int = 2    # c-lora: replicas of the one multi-LoRA engine (one per core)
    # i-lora: replicas of its one engine, each given cores / replicas CPUs, which Ray turns into as many
    # OpenMP threads (OMP_NUM_THREADS); one replica with every core is v-one's stock server's topology
    in_engine_replicas: int = 1

    def engines(self, system: str, n: int) -> int:
        group = self.prefill_replicas + 1  # a prefill module's replicas + one decode group
        return {"a": self.prefill_replicas + n, "b": 2 * n, "c": n, "a-lora": group, "a-sf-lora": group,
                "a-sys-lora": group, "b-lora": group, "c-lora": self.colocated_replicas,
                "i-lora": self.in_engine_replicas,
                "v-lora": 1, "v-one": 1}[system]

    def group_kv_gib(self, n: int) -> float:
        return self.lora_kv_cache_gib or self.kv_cache_gib * n


def machine_cpus() -> int:
    """The cores this process may run on (what a stock server's OpenMP uses)."""
    return len(os.sched_getaffinity(0))


def _bytes(gib: float) -> int:
    """A Topology size in GiB as the app's engine.kv_cache_memory_bytes."""
    return int(gib * (1 << 30))


def decoder_names(n: int) -> list[str]:
    return [f"agent{i}" for i in range(n)]


def lora_adapters(system: str, models: ModelSet) -> tuple[str, ...]:
    """The adapter directories a LoRA system serves."""
    return {"a-sf-lora": models.shared_first, "a-sys-lora": models.system_first}.get(system, models.adapters)


def app_config(system: str, models: ModelSet, n: int, topo: Topology, tokenizer: str, pool_path: str) -> dict:
    """The AppConfig dict (app/config.py) of ``system`` with ``n`` decoders."""
    if system not in SYSTEMS:
        raise ValueError(f"--systems: unknown system {system!r} (choose from {', '.join(SYSTEMS)})")
    if system.startswith("v-"):
        raise ValueError(f"{system} is a stock vLLM server, not an app config (bench/stock_vllm.py)")
    have = len(lora_adapters(system, models)) if system.endswith("-lora") else len(models.shared)
    if n > have:
        raise ValueError(f"--fanouts: {n} decoders asked, {have} model directories prepared")
    engine = {"dtype": topo.dtype, "max_model_len": topo.max_model_len, "kv_cache_memory_bytes": _bytes(topo.kv_cache_gib),
              "block_size": topo.block_size, "max_num_seqs": topo.max_num_seqs, "threads_bind": topo.threads_bind}
    dec_place = {"num_cpus": 0.1, "placement_group_bundles": [{"CPU": 0.1}], "max_ongoing_requests": 64}
    pf_place = {"num_cpus": 0.1, "max_ongoing_requests": 64}
    names = decoder_names(n)
    if system.endswith("-lora"):
        prefill, decoders = _lora_system(system, models, n, topo, engine, dec_place, pf_place)
    elif system == "a":
        prefill = [{"name": "base", "model": models.base, "engine": engine,
                    "placement": {**pf_place, "num_replicas": topo.prefill_replicas}}]
        decoders = [{"name": nm, "model": models.shared[i], "prefill_module": "base", "engine": engine,
                     "placement": dec_place} for i, nm in enumerate(names)]
    elif system == "b":
        prefill = [{"name": f"own-{nm}", "model": models.own[i], "engine": engine, "placement": pf_place}
                   for i, nm in enumerate(names)]
        decoders = [{"name": nm, "model": models.own[i], "prefill_module": f"own-{nm}", "engine": engine,
                     "placement": dec_place} for i, nm in enumerate(names)]
    else:
        prefill = []
        decoders = [{"name": nm, "model": models.shared[i], "prefill_module": None, "engine": engine,
                     "placement": dec_place} for i, nm in enumerate(names)]
    return {
        "tokenizer": tokenizer,
        "prefill_modules": prefill,
        "decoders": decoders,
        "pool": {"path": pool_path, "capacity_bytes": _bytes(topo.pool_gib)},
        "limits": {"max_tokens_default": 16, "max_tokens_cap": topo.max_tokens_cap, "max_agents": topo.max_agents,
                   "max_rounds": topo.max_rounds, "request_timeout_s": topo.request_timeout_s},
        "router": {"num_cpus": 0.05, "max_ongoing_requests": 1024},
        "orchestrator": {"num_cpus": 0.05, "max_ongoing_requests": 1024},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
    }


def _lora_system(system: str, models: ModelSet, n: int, topo: Topology, engine: dict, dec_place: dict,
                 pf_place: dict) -> tuple[list, list]:
    """(prefill modules, decoders) of a LoRA system: one group engine holds the n adapters."""
    paths = lora_adapters(system, models)
    adapters = [{"name": nm, "path": paths[i], "rank": topo.lora_rank} for i, nm in enumerate(decoder_names(n))]
    lora = {"adapters": adapters, "max_lora_rank": topo.lora_rank, "max_loras": n}
    group_engine = {**engine, "kv_cache_memory_bytes": _bytes(topo.group_kv_gib(n)), "max_num_seqs": topo.max_num_seqs * n}
    group = {"name": "lora-group", "model": models.base, "engine": group_engine, "placement": dec_place, **lora}
    pf = {**pf_place, "num_replicas": topo.prefill_replicas}
    if system in ("a-lora", "a-sf-lora", "a-sys-lora"):
        return [{"name": "base", "model": models.base, "engine": engine, "placement": pf}], \
            [{**group, "prefill_module": "base"}]
    if system == "i-lora":  # the base's own engines hold the adapters: its KV space and batch as the group's
        share = {"num_replicas": topo.in_engine_replicas, "num_cpus": machine_cpus() / topo.in_engine_replicas}
        return [{"name": "base", "model": models.base, "engine": group_engine, "placement": {**pf_place, **share},
                 "lora_decoders": adapters, "max_lora_rank": topo.lora_rank, "max_loras": n}], []
    if system == "b-lora":
        return [{"name": "own", "model": models.base, "engine": group_engine, "placement": pf, **lora}], \
            [{**group, "prefill_module": "own"}]
    return [], [{**group, "prefill_module": None, "placement": {**dec_place, "num_replicas": topo.colocated_replicas}}]
