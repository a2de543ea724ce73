"""The vLLM functions app/engine/vllm_plugin.py replaces, checked against the installed vLLM (no
engine): an upgrade that renames one, reshapes its signature or changes the behaviour the plugin
builds on fails here naming the vLLM function, not as wrong tokens of a served decoder. Then the
replacements themselves on small inputs (the CPU LoRA ops against a per-token loop, the per-token
LoRA ids over prefill chunks and decode steps, the prefix-cache keys around the hand-over point),
and ``register()``, which installs nothing unless the engine names hand-over adapters.

The same plugin in a real engine (the shipped chat adapters' tokens equal the transformers hand-over
reference, and they read the base's prefix-cache blocks) is tests/test_in_engine_lora.py."""
from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.lora import model_manager, peft_helper
from vllm.lora.layers.utils import LoRAMapping
from vllm.lora.ops import torch_ops
from vllm.lora.punica_wrapper import punica_cpu
from vllm.lora.punica_wrapper.utils import compute_meta
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core import block_pool, kv_cache_utils
from vllm.v1.request import Request
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from prefillshare.app.engine import vllm_plugin
from prefillshare.app.engine.vllm_plugin import HANDOVER_ADAPTERS_ENV
from prefillshare.app.prompt_split import Activation

ROOT = Path(__file__).resolve().parent.parent
KEYS = "vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys"
POOL_KEYS = "vllm.v1.core.block_pool.generate_block_hash_extra_keys"
MAKE_LORA_INPUTS = "vllm.v1.worker.gpu_input_batch.InputBatch.make_lora_inputs"
PUNICA = "vllm.lora.model_manager.get_punica_wrapper"
SHRINK = "vllm.lora.punica_wrapper.punica_cpu.sgmv_shrink"
EXPAND = "vllm.lora.punica_wrapper.punica_cpu.sgmv_expand"
EXPAND_SLICE = "vllm.lora.punica_wrapper.punica_cpu.sgmv_expand_slice"
LORA_LINEAR = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU.add_lora_linear"
LORA_LOGITS = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU.add_lora_logits"
VALIDATE = "vllm.lora.peft_helper.PEFTHelper._validate_features"
# what register() replaces: vLLM's name for it, owner, attribute, the plugin's replacement
REPLACED = [
    (VALIDATE, peft_helper.PEFTHelper, "_validate_features", vllm_plugin._validate_features),
    (KEYS, kv_cache_utils, "generate_block_hash_extra_keys", vllm_plugin._block_hash_extra_keys),
    (POOL_KEYS, block_pool, "generate_block_hash_extra_keys", vllm_plugin._block_hash_extra_keys),
    (MAKE_LORA_INPUTS, InputBatch, "make_lora_inputs", vllm_plugin._make_lora_inputs),
    (PUNICA, model_manager, "get_punica_wrapper", vllm_plugin._punica_wrapper),
    (LORA_LINEAR, punica_cpu.PunicaWrapperCPU, "add_lora_linear", vllm_plugin._add_lora_linear),
    (LORA_LOGITS, punica_cpu.PunicaWrapperCPU, "add_lora_logits", vllm_plugin._add_lora_logits),
    (SHRINK, punica_cpu, "sgmv_shrink", vllm_plugin._sgmv_shrink),
    (EXPAND, punica_cpu, "sgmv_expand", vllm_plugin._sgmv_expand),
    (EXPAND_SLICE, punica_cpu, "sgmv_expand_slice", vllm_plugin._sgmv_expand_slice),
]
_RUNS = ["output_tensor", "b_seq_start_loc", "seq_len_tensor", "lora_indices_tensor", "batches", "max_seq_length",
         "token_nums"]
# the parameters the plugin's replacements take (and pass on to vLLM's own function), in order
PARAMS = {
    VALIDATE: ["self"],
    KEYS: ["request", "start_token_idx", "end_token_idx", "start_mm_idx"],
    POOL_KEYS: ["request", "start_token_idx", "end_token_idx", "start_mm_idx"],
    MAKE_LORA_INPUTS: ["self", "num_scheduled_tokens", "num_sampled_tokens"],
    PUNICA: ["args", "kwargs"],
    LORA_LINEAR: ["self", "y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "output_slices", "buffer", "kwargs"],
    LORA_LOGITS: ["self", "y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "buffer", "kwargs"],
    SHRINK: ["inputs", "lora_a_weights", *_RUNS, "scaling"],
    EXPAND: ["inputs", "lora_b_weights", *_RUNS, "add_inputs"],
    EXPAND_SLICE: ["inputs", "lora_b_weights", *_RUNS, "slice_offset", "slice_size", "add_inputs"],
}
HANDOVER, OTHER, ALORA = "chat-h", "chat-o", "chat-a"  # a hand-over adapter, an ordinary one, an Activated LoRA one
INVOKE = (7, 8)  # ALORA's invocation tokens


def _vllms(label: str, owner, attr: str):
    """The installed vLLM's own function (this test process never runs the plugin's register)."""
    fn = getattr(owner, attr, None)
    assert fn is not None, f"{label}: the installed vLLM has no such function (the plugin replaces it)"
    assert fn.__module__.startswith("vllm."), f"{label} is {fn.__module__}.{fn.__qualname__} in the test process"
    return fn


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.fixture
def none_hash(monkeypatch):
    """vLLM's first-block parent hash, which the engine core sets when it starts."""
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", kv_cache_utils.BlockHash(sha256("test-none-hash")),
                        raising=False)


@pytest.fixture
def adapters(monkeypatch):
    """The plugin as in an engine whose hand-over adapter is HANDOVER, with vLLM's own functions behind it."""
    monkeypatch.setattr(vllm_plugin, "_ADAPTERS", {HANDOVER: Activation(), ALORA: Activation(INVOKE)})
    for label, owner, attr, _ in REPLACED:
        monkeypatch.setitem(vllm_plugin._VLLM, attr, _vllms(label, owner, attr))


def _lora(name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, f"/adapters/{name}")


def _request(rid: str, n: int, lora: LoRARequest | None = None, salt: str | None = None, hasher=None) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=1), None, lora_request=lora,
                   cache_salt=salt, block_hasher=hasher)


# --- the installed vLLM: what the plugin replaces, as it assumes it ---------------------------------

@pytest.mark.parametrize("label, owner, attr, ours", REPLACED, ids=[r[0] for r in REPLACED])
def test_each_replaced_function_keeps_the_signature_the_plugin_takes(label, owner, attr, ours):
    theirs = _params(_vllms(label, owner, attr))
    assert [name for name, _ in theirs] == PARAMS[label], (
        f"{label}: vLLM's parameters are now {[n for n, _ in theirs]}; app/engine/vllm_plugin.py's "
        f"{ours.__name__} takes {PARAMS[label]}")
    assert theirs == _params(ours), f"{label}: vLLM's defaults {theirs} differ from {ours.__name__}'s {_params(ours)}"


def test_the_lora_key_is_a_tuple_led_by_lora_and_dropping_it_leaves_the_bases_keys():
    """The plugin keys an adapter's early block as the base's by dropping the keys whose first item
    is "lora": that must leave exactly what the base request gets (the salt, or None)."""
    keys = _vllms(KEYS, kv_cache_utils, "generate_block_hash_extra_keys")
    lora = _lora(HANDOVER, 1)
    for salt in ("tenant-a", None):
        for start in (0, 4):  # the salt keys the first block only
            got, mm = keys(_request("a", 12, lora, salt), start, start + 4, 0)
            assert isinstance(got, tuple) and mm == 0, f"{KEYS} returned {got!r}, {mm!r}"
            lora_keys = [k for k in got if isinstance(k, tuple) and k[0] == "lora"]
            assert len(lora_keys) == 1 and HANDOVER in lora_keys[0], (
                f"{KEYS}: no key tuple led by 'lora' naming the adapter in {got!r}")
            base, _ = keys(_request("b", 12, None, salt), start, start + 4, 0)
            assert (tuple(k for k in got if k[0] != "lora") or None) == base, (
                f"{KEYS}: without its 'lora' key an adapter's block keys {got!r} are not the base's {base!r}")
    assert keys(_request("b", 12), 0, 4, 0) == (None, 0), f"{KEYS}: a plain base block is no longer keyed None"


def test_the_block_hasher_looks_the_key_function_up_when_it_runs(monkeypatch, none_hash):
    hasher = kv_cache_utils.get_request_block_hasher(4, sha256)  # built before the swap, as an engine's is
    stock = _vllms(KEYS, kv_cache_utils, "generate_block_hash_extra_keys")
    calls = []

    def spy(request, start_token_idx, end_token_idx, start_mm_idx):
        calls.append((request.request_id, start_token_idx, end_token_idx))
        return stock(request, start_token_idx, end_token_idx, start_mm_idx)

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", spy)
    req = _request("r", 10, _lora(HANDOVER, 1), hasher=hasher)
    assert calls == [("r", 0, 4), ("r", 4, 8)], (
        f"vllm.v1.core.kv_cache_utils.get_request_block_hasher no longer calls the module global {KEYS} per "
        f"block when it runs (calls seen: {calls})")
    assert len(req.block_hashes) == 2


def test_block_pool_calls_kv_cache_utils_key_function_by_the_name_it_imported():
    assert _vllms(POOL_KEYS, block_pool, "generate_block_hash_extra_keys") is kv_cache_utils.generate_block_hash_extra_keys, (
        f"{POOL_KEYS} is no longer {KEYS} (the plugin keeps one vLLM original for both)")
    tree = ast.parse(inspect.getsource(block_pool))
    imported = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == kv_cache_utils.__name__
                for a in n.names}
    assert "generate_block_hash_extra_keys" in imported, f"{POOL_KEYS}: block_pool no longer imports it by name"
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "generate_block_hash_extra_keys"]
    assert calls, f"{POOL_KEYS}: block_pool no longer calls it by its module-global name"


# vLLM modules that import the key function by name, and why the plugin does not replace their copy
NAME_IMPORTERS = {
    "vllm/v1/core/block_pool.py": "replaced by the plugin",
    "vllm/v1/simple_kv_offload/manager.py": "vLLM's SimpleCPUOffloadConnector, which the project never configures",
}


def test_no_other_vllm_module_holds_its_own_copy_of_the_key_function():
    """A module that imports the key function by name keeps vLLM's own after register(): an unknown one
    would key an adapter's early blocks apart from the base's."""
    pkg = Path(kv_cache_utils.__file__).resolve().parents[2]  # .../vllm
    found = set()
    for path in pkg.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "generate_block_hash_extra_keys" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and any(a.name == "generate_block_hash_extra_keys" for a in node.names):
                found.add(path.relative_to(pkg.parent).as_posix())
    assert found == set(NAME_IMPORTERS), (
        f"{KEYS} is imported by name in {sorted(found)}; the plugin knows {sorted(NAME_IMPORTERS)}")


def _state(rid: str, n: int, lora: LoRARequest | None, computed: int = 0) -> CachedRequestState:
    return CachedRequestState(req_id=rid, prompt_token_ids=list(range(n)), mm_features=[],
                              sampling_params=SamplingParams(temperature=0.0, max_tokens=4), generator=None,
                              block_ids=([0],), num_computed_tokens=computed, output_token_ids=[], lora_request=lora)


def _input_batch(states) -> InputBatch:
    batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=torch.device("cpu"),
                       vocab_size=1000, block_sizes=[16], max_num_blocks_per_req=[4])
    for s in states:
        batch.add_request(s)
    return batch


def test_input_batch_holds_what_the_plugin_reads_per_request():
    h, o = _lora(HANDOVER, 1), _lora(OTHER, 2)
    batch = _input_batch([_state("a", 10, h, computed=6), _state("b", 5, None, computed=5), _state("c", 6, o)])
    where = "vllm.v1.worker.gpu_input_batch.InputBatch"
    assert batch.num_reqs == 3, f"{where}.num_reqs"
    for attr, want in [("num_prompt_tokens", [10, 5, 6]), ("num_computed_tokens_cpu", [6, 5, 0]),
                       ("request_lora_mapping", [1, 0, 2])]:
        got = getattr(batch, attr, None)
        assert isinstance(got, np.ndarray) and got[:3].tolist() == want, f"{where}.{attr}: {got!r}, wanted {want} first"
    assert {i: r.lora_name for i, r in batch.lora_id_to_lora_request.items()} == {1: HANDOVER, 2: OTHER}, (
        f"{where}.lora_id_to_lora_request: {batch.lora_id_to_lora_request!r}")
    prompt, tokens, requests = batch.make_lora_inputs(np.array([4, 1, 6]), np.array([1, 1, 0]))
    assert (list(prompt), list(tokens), requests) == ([1, 0], [1] * 4 + [0] + [2] * 6, {h, o}), (
        f"{MAKE_LORA_INPUTS}: no longer one id per scheduled token, requests in batch order")


def test_the_runner_sets_loras_from_the_step_whose_positions_start_at_the_computed_tokens():
    """The plugin takes a token's position as the request's num_computed_tokens_cpu + its offset in
    the step, as the runner's _prepare_inputs does; CPU engines run the GPU runner's, always with SGMV."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    prepare = inspect.getsource(GPUModelRunner._prepare_inputs)
    assert "num_computed_tokens_cpu[req_indices]" in prepare and "set_active_loras(" in prepare, (
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs: positions no longer from "
        "num_computed_tokens_cpu in the step that sets the LoRA inputs")
    written = [n for n in ast.walk(ast.parse(textwrap.dedent(prepare)))
               if isinstance(n, (ast.Assign, ast.AugAssign))
               and "num_computed_tokens_cpu" in ast.dump(n.targets[0] if isinstance(n, ast.Assign) else n.target)]
    assert not written, "GPUModelRunner._prepare_inputs now changes num_computed_tokens_cpu before the LoRA inputs"
    assert issubclass(CPUModelRunner, GPUModelRunner)
    assert not {"_prepare_inputs", "set_active_loras"} & set(vars(CPUModelRunner)), (
        "vllm.v1.worker.cpu_model_runner.CPUModelRunner overrides the LoRA input path")
    assert "input_batch.make_lora_inputs(" in inspect.getsource(LoRAModelRunnerMixin.set_active_loras), (
        f"LoRAModelRunnerMixin.set_active_loras no longer calls {MAKE_LORA_INPUTS}")
    assert "is_prefill=True" in inspect.getsource(LoRAModelRunnerMixin._set_active_loras), (
        "LoRAModelRunnerMixin._set_active_loras: CPU steps may now take bgmv_*, which the plugin does not replace")


def test_an_engine_with_hand_over_adapters_runs_vllms_v1_model_runner(monkeypatch):
    """The per-token ids live in the V1 runner's InputBatch; vLLM's V2 runner (its GPU default with
    Triton) keeps them in gpu/lora_utils.LoraState, which the plugin does not touch. The env the plugin
    asks for must still select V1."""
    from vllm import envs

    from prefillshare.app.engine.async_engine import EngineConfig

    ec = EngineConfig(model="checkpoints/base", lora_adapters=(("h", "x"),), handover_adapters=("h",))
    assert ec.core_env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in EngineConfig(model="checkpoints/base").core_env
    for k, v in vllm_plugin.HANDOVER_ENGINE_ENV.items():
        monkeypatch.setenv(k, v)
    assert envs.VLLM_USE_V2_MODEL_RUNNER is False, "vllm.envs.VLLM_USE_V2_MODEL_RUNNER: '0' no longer turns V2 off"


def test_an_engine_with_hand_over_adapters_refuses_to_start_without_the_plugin(monkeypatch):
    """Fail closed: an engine vLLM would run without the plugin (VLLM_PLUGINS leaving it out, no entry
    point, the V2 runner forced) would apply its adapters on every prompt token under the base's keys."""
    import asyncio

    from prefillshare.app.engine.async_engine import Engine, EngineConfig, EngineError

    vllm_plugin.check_loadable({})  # this venv installs the entry point
    with pytest.raises(vllm_plugin.PluginNotActiveError, match="VLLM_PLUGINS"):
        vllm_plugin.check_loadable({"VLLM_PLUGINS": "lora_filesystem_resolver"})
    monkeypatch.setattr(vllm_plugin, "PLUGIN_NAME", "not-installed")
    with pytest.raises(vllm_plugin.PluginNotActiveError, match="not installed"):
        vllm_plugin.check_loadable({})
    monkeypatch.undo()
    vllm_plugin.check_engine(NS(use_v2_model_runner=False))
    with pytest.raises(vllm_plugin.PluginNotActiveError, match="V2 model runner"):
        vllm_plugin.check_engine(NS(use_v2_model_runner=True))
    cfg = EngineConfig(model=str(ROOT / "checkpoints" / "base"), handover_adapters=("chat-route",),
                       lora_adapters=(("chat-route", str(ROOT / "checkpoints" / "chat" / "adapters" / "route")),),
                       extra_env={"VLLM_PLUGINS": "lora_filesystem_resolver"})
    with pytest.raises(EngineError, match="leaves out 'prefillshare'"):
        asyncio.run(Engine.start(cfg))  # refused before any engine process starts


def test_the_model_manager_sizes_its_lora_wrapper_by_max_batches_given_by_keyword():
    """The plugin doubles ``max_batches`` where vLLM's model manager builds its punica wrapper: every
    call there must pass it by keyword, and the wrapper must size its per-run buffers by it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(model_manager)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "get_punica_wrapper"]
    assert calls, f"{PUNICA}: vLLM's model manager no longer calls it by that name"
    assert all(any(k.arg == "max_batches" for k in c.keywords) for c in calls), \
        f"{PUNICA}: a call in vllm.lora.model_manager does not pass max_batches by keyword"
    w = punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=64, max_batches=5, device="cpu")
    assert w._seq_lengths.shape[0] == 5, "vllm.lora.punica_wrapper.punica_base: per-run buffers no longer max_batches"


def test_punica_cpu_calls_the_torch_ops_by_the_names_it_imported():
    tree = ast.parse(inspect.getsource(punica_cpu))
    imported = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == torch_ops.__name__
                for a in n.names}
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    for label, name in [(SHRINK, "sgmv_shrink"), (EXPAND, "sgmv_expand"), (EXPAND_SLICE, "sgmv_expand_slice")]:
        assert name in imported and _vllms(label, punica_cpu, name) is getattr(torch_ops, name), (
            f"{label}: punica_cpu no longer imports it by name from {torch_ops.__name__}")
        assert name in called, f"{label}: PunicaWrapperCPU no longer calls it by its module-global name"


def test_punica_cpu_hands_the_sgmv_ops_runs_of_tokens_with_index_minus_one_for_lora_id_0():
    """What the replaced sgmv ops get: the six prefill metadata items between the output and the last
    argument, one run per stretch of tokens with one adapter slot, -1 for LoRA id 0 (no adapter)."""
    w = punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=16, max_batches=4, device="cpu")
    # slots: 0 holds LoRA id 1, 1 holds id 2
    w.update_metadata(LoRAMapping((0, 0, 1, 1, 1, 2, 0, 0), (1,), is_prefill=True), [1, 2, None], 3, 100)
    starts, lengths, indices, batches, max_len, tokens = w.prefill_metadata
    assert (starts.tolist(), lengths.tolist(), indices.tolist(), batches, max_len, tokens) == (
        [0, 2, 5, 6], [2, 3, 1, 2], [-1, 0, 1, -1], 4, 3, 8), (
        f"vllm.lora.punica_wrapper.punica_base.PunicaWrapperBase.prefill_metadata (what {SHRINK} gets): "
        f"{w.prefill_metadata}")
    assert w.is_prefill and not w.no_lora


def test_vllms_torch_ops_read_index_minus_one_as_the_last_adapter_slot():
    """Stock behaviour, the reason the plugin replaces the CPU sgmv ops: a token without an adapter
    gets the last slot's adapter."""
    torch.manual_seed(0)
    a = torch.randn(3, 1, 2, 4)  # 3 slots, rank 2, hidden 4
    x = torch.randn(1, 4).repeat(2, 1)
    out = torch.zeros(2, 2)
    torch_ops.bgmv_shrink(x, a, out, torch.tensor([-1, 2]), 1.0)
    assert torch.equal(out[0], out[1]) and out[0].abs().sum() > 0, (
        f"vllm.lora.ops.torch_ops.bgmv_shrink: index -1 no longer reads the last slot ({out.tolist()})")
    meta = compute_meta(torch.tensor([-1, -1]))[:6]
    out = torch.zeros(2, 2)
    _vllms(SHRINK, punica_cpu, "sgmv_shrink")(x, a, out, *meta, 1.0)
    assert torch.allclose(out, x @ a[2, 0].T), f"{SHRINK}: a run of index -1 no longer gets the last slot"
    vllm_plugin._sgmv_shrink(x, a, out, *meta, 1.0)
    assert not out.any()  # the plugin's: no adapter


# --- the plugin's replacements ------------------------------------------------------------------------

RUNS = [-1, -1, 0, 0, 0, 2, -1, -1, -1]  # per token: runs of slots [-1, 0, 2, -1]


def _meta(token_slots):
    starts, lengths, indices, batches, max_len, tokens, _ = compute_meta(torch.tensor(token_slots))
    return starts, lengths, indices, batches, max_len, tokens


def _slot(stacked, i):
    w = stacked[i]
    return w[0] if w.dim() == 3 else w


def _ref_shrink(x, a, out, slots, scaling):
    out = out.clone()
    for t, i in enumerate(slots):
        out[t] = 0 if i < 0 else scaling * (x[t] @ _slot(a, i).T)
    return out


def _ref_expand(x, b, out, slots, offset, add):
    out = out.clone()
    for t, i in enumerate(slots):
        cols = slice(offset, offset + b.shape[-2])
        if i < 0:
            if not add:
                out[t, cols] = 0
            continue
        y = x[t] @ _slot(b, i).T
        out[t, cols] = out[t, cols] + y if add else y
    return out


SHAPES = [(16, 4, 12, 3, True), (24, 8, 8, 4, False), (7, 2, 5, 3, True)]  # hidden, rank, out, slots, 4-d weights


@pytest.mark.parametrize("hidden, rank, out_features, slots, four_d", SHAPES)
@pytest.mark.parametrize("add", [False, True])
def test_the_sgmv_replacements_apply_each_runs_adapter_and_none_to_index_minus_one(hidden, rank, out_features,
                                                                                 slots, four_d, add):
    meta = _meta(RUNS)
    assert meta[2].tolist() == [-1, 0, 2, -1]
    n = len(RUNS)
    none = torch.tensor(RUNS) < 0
    a = torch.randn(slots, *([1] if four_d else []), rank, hidden)
    b = torch.randn(slots, *([1] if four_d else []), out_features, rank)
    x = torch.randn(n, hidden)

    shrunk = torch.randn(n, rank)  # the plugin overwrites (vLLM's buffer is not zeroed)
    want = _ref_shrink(x, a, shrunk, RUNS, 0.5)
    vllm_plugin._sgmv_shrink(x, a, shrunk, *meta, 0.5)
    assert torch.allclose(shrunk, want, atol=1e-5) and not shrunk[none].any() and shrunk[~none].abs().sum() > 0

    h = torch.randn(n, rank)
    before = torch.randn(n, out_features)
    out = before.clone()
    vllm_plugin._sgmv_expand(h, b, out, *meta, add_inputs=add)
    assert torch.allclose(out, _ref_expand(h, b, before, RUNS, 0, add), atol=1e-5)
    assert torch.equal(out[none], before[none]) if add else not out[none].any()
    assert (out - before)[~none].abs().amax(1).min() > 1e-3  # the adapters did act, on every token of theirs

    before = torch.randn(n, 3 * out_features)  # a slice of a merged output (q, k, v)
    out = before.clone()
    vllm_plugin._sgmv_expand_slice(h, b, out, *meta, out_features, out_features, add_inputs=add)
    assert torch.allclose(out, _ref_expand(h, b, before, RUNS, out_features, add), atol=1e-5)
    others = torch.cat([out[:, :out_features], out[:, 2 * out_features:]], 1)
    assert torch.equal(others, torch.cat([before[:, :out_features], before[:, 2 * out_features:]], 1))


SLICES = (12, 4, 4)  # a merged q, k, v projection's output widths


def _wrapper(token_slots: list[int], slot_ids: list[int | None]):
    """vLLM's CPU LoRA wrapper after a step's mapping (``slot_ids``: the LoRA id each slot holds)."""
    w = punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=32, max_batches=8, device="cpu")
    by_slot = {i: lora_id for i, lora_id in enumerate(slot_ids) if lora_id}
    lora_ids = tuple(by_slot[i] if i >= 0 else 0 for i in token_slots)
    w.update_metadata(LoRAMapping(lora_ids, (1,), is_prefill=True), list(slot_ids), len(slot_ids), 100)
    assert w.token_lora_indices.tolist() == token_slots, (
        f"vllm.lora.punica_wrapper.punica_base.PunicaWrapperBase.token_lora_indices: {w.token_lora_indices.tolist()}")
    return w


def _ref_linear(y, x, a, b, slots, scale):
    """Per token with an adapter: y[:, slice] += scale * x @ A[slot, slice]^T @ B[slot, slice]^T."""
    out, offset = y.clone(), 0
    for a_s, b_s, size in zip(a, b, SLICES):
        for t, i in enumerate(slots):
            if i >= 0:
                out[t, offset: offset + size] += scale * (x[t] @ _slot(a_s, i).T) @ _slot(b_s, i)[:size].T
        offset += size
    return out


def _layer(slots: int, rank: int = 4, hidden: int = 16):
    a = tuple(torch.randn(slots, 1, rank, hidden) for _ in SLICES)
    b = tuple(torch.randn(slots, 1, size, rank) for size in SLICES)
    return a, b


@pytest.mark.parametrize("token_slots", [[0, 2, 1, 0], [0, -1, 2, 1], [-1, -1, -1, 1, -1, 0, 0, -1]],
                         ids=["decode", "decode-with-base", "prefill-tail"])
def test_a_lora_linear_step_is_one_product_each_way_for_every_slice_and_equals_the_reference(token_slots):
    """The layer's slices side by side, over its tokens with an adapter only, equal to the per-token
    reference; a token without one keeps the base's output. Also after the step's mapping changes and
    after a slot's weights are rewritten in place (the fused matrices are rebuilt)."""
    a, b = _layer(3)
    slots = token_slots
    for _ in range(2):
        w = _wrapper(slots, [1, 2, 3])
        x, y = torch.randn(len(slots), 16), torch.randn(len(slots), sum(SLICES))
        want = _ref_linear(y, x, a, b, slots, 0.5)
        out = y.clone()
        vllm_plugin._add_lora_linear(w, out, x, a, b, 0.5, SLICES)
        assert torch.allclose(out, want, atol=1e-4)
        none = torch.tensor(slots) < 0
        assert torch.equal(out[none], y[none]) and (out - y)[~none].abs().amax(1).min() > 1e-3
        assert vllm_plugin._STEP[0].count == int((~none).sum())  # the fused path ran
        slots = [s if s < 0 else (s + 1) % 3 for s in slots]  # the next step's adapters
        a[1][2].mul_(2)  # an adapter loaded into a slot in place (vLLM copies into its stacked weights)
        b[0][1].add_(1)


def test_a_step_with_many_adapter_tokens_takes_vllms_per_slice_loop_with_the_plugins_per_run_ops(monkeypatch):
    """Past FUSED_MAX_ROWS the layer runs vLLM's own add_lora_linear, which calls the sgmv ops: the
    plugin's per-run ones give the same result (a token without an adapter untouched)."""
    for name, ours in (("sgmv_shrink", vllm_plugin._sgmv_shrink), ("sgmv_expand", vllm_plugin._sgmv_expand),
                       ("sgmv_expand_slice", vllm_plugin._sgmv_expand_slice)):
        monkeypatch.setattr(punica_cpu, name, ours)
    monkeypatch.setitem(vllm_plugin._VLLM, "add_lora_linear", _vllms(LORA_LINEAR, punica_cpu.PunicaWrapperCPU,
                                                                     "add_lora_linear"))
    monkeypatch.setattr(vllm_plugin, "FUSED_MAX_ROWS", 0)
    slots = [-1, -1, 0, 0, 0, 2, -1, 1]
    a, b = _layer(3)
    w, x, y = _wrapper(slots, [1, 2, 3]), torch.randn(len(slots), 16), torch.randn(len(slots), sum(SLICES))
    vllm_plugin._STEP[0] = None
    out = y.clone()
    vllm_plugin._add_lora_linear(w, out, x, a, b, 0.5, SLICES)
    assert torch.allclose(out, _ref_linear(y, x, a, b, slots, 0.5), atol=1e-4)
    assert vllm_plugin._STEP[0].count == 5  # read, then handed to vLLM's loop


def test_the_fused_layer_equals_vllms_own_lora_linear_where_every_token_has_an_adapter():
    """Against vLLM's PunicaWrapperCPU.add_lora_linear with vLLM's own ops (right where no token lacks
    an adapter), on a merged projection."""
    a, b = _layer(4)
    slots = [3, 0, 2, 1, 1, 0]
    w, x, y = _wrapper(slots, [1, 2, 3, 4]), torch.randn(len(slots), 16), torch.randn(len(slots), sum(SLICES))
    theirs, ours = y.clone(), y.clone()
    _vllms(LORA_LINEAR, punica_cpu.PunicaWrapperCPU, "add_lora_linear")(w, theirs, x, a, b, 1.0, SLICES)
    vllm_plugin._add_lora_linear(w, ours, x, a, b, 1.0, SLICES)
    assert torch.allclose(ours, theirs, atol=1e-4) and (ours - y).abs().amax(1).min() > 1e-3


def _logits_wrapper(sampled_slots: list[int], slot_ids: list[int | None]):
    """A wrapper whose step samples one row per request, each with its slot (-1: no adapter)."""
    w = punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=32, max_batches=8, device="cpu")
    by_slot = {i: lora_id for i, lora_id in enumerate(slot_ids) if lora_id}
    ids = tuple(by_slot[i] if i >= 0 else 0 for i in sampled_slots)
    w.update_metadata(LoRAMapping(ids, ids, is_prefill=True), list(slot_ids), len(slot_ids), 100)
    assert w.sampler_indices.tolist() == sampled_slots, (
        f"vllm.lora.punica_wrapper.punica_base.PunicaWrapperBase.sampler_indices: {w.sampler_indices.tolist()}")
    return w


def test_the_lm_heads_lora_runs_only_for_rows_whose_slot_holds_head_weights():
    """Adapters of attention and MLP leave the head's slots zero: nothing is added (vLLM runs its ops on
    every row). A slot that holds head weights acts on its own rows only; a row without an adapter keeps
    the base's logits (vLLM's ops give it the last slot's), and where every row has an adapter the
    result is vLLM's."""
    a, b = torch.randn(3, 1, 4, 16), torch.zeros(3, 1, 40, 4)
    w, x, y = _logits_wrapper([0, -1, 2], [1, 2, 3]), torch.randn(3, 16), torch.randn(3, 40)
    out = y.clone()
    vllm_plugin._add_lora_logits(w, out, x, a, b, 1.0)
    assert torch.equal(out, y)
    b[2].normal_()  # the third adapter has head weights
    vllm_plugin._add_lora_logits(w, out, x, a, b, 1.0)
    want = y.clone()
    want[2] += (x[2] @ a[2, 0].T) @ b[2, 0].T
    assert torch.allclose(out, want, atol=1e-4) and torch.equal(out[:2], y[:2])
    b.normal_()
    every = _logits_wrapper([2, 0, 1], [1, 2, 3])
    theirs, ours = y.clone(), y.clone()
    _vllms(LORA_LOGITS, punica_cpu.PunicaWrapperCPU, "add_lora_logits")(every, theirs, x, a, b, 1.0)
    vllm_plugin._add_lora_logits(every, ours, x, a, b, 1.0)
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_a_slot_whose_weights_are_all_zero_gets_no_product_and_adds_nothing():
    """The embeddings' LoRA runs through the per-run ops every step; slots the adapters leave zero
    add nothing (and overwrite with zeros where the op does not add), as computing them would."""
    meta = _meta(RUNS)
    b = torch.zeros(3, 1, 12, 4)
    b[2].normal_()  # slot 2 live, slot 0 zero
    h, before = torch.randn(len(RUNS), 4), torch.randn(len(RUNS), 12)
    for add in (True, False):
        out = before.clone()
        vllm_plugin._sgmv_expand(h, b, out, *meta, add_inputs=add)
        assert torch.allclose(out, _ref_expand(h, b, before, RUNS, 0, add), atol=1e-5)
    assert vllm_plugin._live(b) == {2}
    b[0, 0, 0, 0] = 1.0  # written in place (an adapter loaded into slot 0): seen
    assert vllm_plugin._live(b) == {0, 2}


def test_a_steps_runs_are_read_once_though_vllm_hands_each_op_fresh_views():
    """vLLM's wrapper hands every op new views of its metadata buffers (``prefill_metadata``); the
    runs are read once per step, and again once the wrapper refills the buffers for the next step."""
    w = _wrapper([-1, 0, 0, 1], [1, 2])
    first = vllm_plugin._runs(*w.prefill_metadata[:3])
    assert w.prefill_metadata[0] is not w.prefill_metadata[0]  # fresh views on every call
    assert vllm_plugin._runs(*w.prefill_metadata[:3]) is first
    by_slot = {0: 1, 1: 2}
    w.update_metadata(LoRAMapping(tuple(by_slot[i] if i >= 0 else 0 for i in [1, 1, -1, 0]), (1,), is_prefill=True),
                      [1, 2], 2, 100)
    again = vllm_plugin._runs(*w.prefill_metadata[:3])
    assert again is not first and [i for _, i in again.runs] == [1, -1, 0]


def test_a_step_without_adapters_leaves_the_base_output():
    a, b = _layer(2)
    w = _wrapper([-1, -1, -1], [1, 2])
    assert w.no_lora  # vLLM's own flag for it, read first
    y = torch.randn(3, sum(SLICES))
    out = y.clone()
    vllm_plugin._add_lora_linear(w, out, torch.randn(3, 16), a, b, 1.0, SLICES)
    assert torch.equal(out, y)


def test_vllms_lora_linear_layer_calls_the_wrapper_in_place_on_the_cpu():
    """The replacement adds into ``y`` and returns None: vLLM's layer must call add_lora_linear with the
    layer's output and keep that tensor (the CPU platform updates in place)."""
    from vllm.lora.layers import base_linear
    from vllm.platforms import current_platform

    source = inspect.getsource(base_linear.BaseLinearLayerWithLoRA._apply_lora_to_output)
    assert "self.punica_wrapper.add_lora_linear(" in source and "output, x, self.lora_a_stacked" in source, (
        "vllm.lora.layers.base_linear.BaseLinearLayerWithLoRA._apply_lora_to_output no longer calls "
        f"{LORA_LINEAR} on its output")
    assert current_platform.can_update_inplace(), "vllm.platforms: the CPU platform no longer updates in place"


@pytest.mark.parametrize("add", [False, True])
def test_the_sgmv_replacements_equal_vllms_ops_where_every_token_has_an_adapter(add):
    slots = [0, 0, 2, 1, 1, 1, 0]
    meta = _meta(slots)
    a, b = torch.randn(3, 1, 4, 16), torch.randn(3, 1, 12, 4)
    x, h = torch.randn(len(slots), 16), torch.randn(len(slots), 4)
    for ours, theirs, args in [
        (vllm_plugin._sgmv_shrink, torch_ops.sgmv_shrink, (x, a, torch.zeros(len(slots), 4), *meta, 0.5)),
        (vllm_plugin._sgmv_expand, torch_ops.sgmv_expand, (h, b, torch.randn(len(slots), 12), *meta, add)),
        (vllm_plugin._sgmv_expand_slice, torch_ops.sgmv_expand_slice,
         (h, b, torch.randn(len(slots), 36), *meta, 12, 12, add)),
    ]:
        out_ours, out_theirs = args[2].clone(), args[2].clone()
        ours(*args[:2], out_ours, *args[3:])
        theirs(*args[:2], out_theirs, *args[3:])
        assert torch.allclose(out_ours, out_theirs, atol=1e-5), ours.__name__


class FakeBatch:
    """The InputBatch attributes the plugin and vLLM's make_lora_inputs read; one spare slot past
    num_reqs (an InputBatch holds max_num_reqs rows)."""

    def __init__(self, prompt_lens, computed, lora_ids):
        self.num_reqs = len(prompt_lens)
        self.num_prompt_tokens = np.array([*prompt_lens, 99], dtype=np.int32)
        self.num_computed_tokens_cpu = np.array([*computed, 0], dtype=np.int32)
        self.request_lora_mapping = np.array([*lora_ids, 1], dtype=np.int64)
        loras = {1: _lora(HANDOVER, 1), 2: _lora(OTHER, 2), 3: _lora(ALORA, 3)}
        self.lora_id_to_lora_request = {i: loras[i] for i in lora_ids if i}


def _ids(batch, scheduled, sampled=None):
    sampled = np.ones(len(scheduled), dtype=np.int32) if sampled is None else np.array(sampled)
    prompt, tokens, requests = vllm_plugin._make_lora_inputs(batch, np.array(scheduled, dtype=np.int32), sampled)
    stock = InputBatch.make_lora_inputs(batch, np.array(scheduled, dtype=np.int32), sampled)
    assert list(prompt) == list(stock[0]) and requests == stock[2]  # the sampler's ids and the requests stay vLLM's
    assert len(tokens) == sum(scheduled)
    return [int(t) for t in tokens]


# (prompt lengths, computed tokens, LoRA ids, scheduled tokens) -> per-token LoRA ids. Request a:
# the hand-over adapter (id 1), 10 prompt tokens, hand-over point 9; b: the base; c: another adapter.
STEPS = [
    ("first prefill chunk", [10, 4, 6], [0, 0, 0], [1, 0, 2], [6, 4, 6], [0] * 6 + [0] * 4 + [2] * 6),
    ("chunk that reaches the hand-over point", [10, 4, 6], [6, 4, 6], [1, 0, 2], [4, 1, 1], [0, 0, 0, 1, 0, 2]),
    ("chunk that ends just before it", [10, 4], [0, 0], [1, 0], [9, 4], [0] * 9 + [0] * 4),
    ("the hand-over token alone", [10, 4], [9, 4], [1, 0], [1, 1], [1, 0]),
    ("decode", [10, 4, 6], [10, 4, 6], [1, 0, 2], [1, 1, 1], [1, 0, 2]),
    ("whole prompt in one step, c first", [6, 10], [0, 0], [2, 1], [6, 10], [2] * 6 + [0] * 9 + [1]),
    ("only another adapter", [6, 3], [0, 0], [2, 0], [6, 3], [2] * 6 + [0] * 3),
]


@pytest.mark.parametrize("prompts, computed, lora_ids, scheduled, want", [s[1:] for s in STEPS],
                         ids=[s[0] for s in STEPS])
def test_a_hand_over_adapter_gets_lora_id_0_before_the_hand_over_point(adapters, prompts, computed, lora_ids,
                                                                         scheduled, want):
    assert _ids(FakeBatch(prompts, computed, lora_ids), scheduled) == want


def test_a_batch_without_hand_over_adapters_keeps_vllms_ids(adapters, monkeypatch):
    batch = FakeBatch([10, 4, 6], [0, 0, 0], [1, 0, 2])
    monkeypatch.setattr(vllm_plugin, "_ADAPTERS", {})  # an engine whose adapters are all ordinary
    assert _ids(batch, [6, 4, 6]) == [1] * 6 + [0] * 4 + [2] * 6


def test_the_lora_ids_on_vllms_own_input_batch(adapters):
    batch = _input_batch([_state("a", 10, _lora(HANDOVER, 1), computed=6), _state("b", 5, None, computed=5),
                          _state("c", 6, _lora(OTHER, 2))])
    _, tokens, _ = vllm_plugin._make_lora_inputs(batch, np.array([4, 1, 6]), np.array([1, 1, 0]))
    assert list(tokens) == [0, 0, 0, 1, 0] + [2] * 6


def test_a_full_batch_of_hand_over_requests_in_prefill_fits_vllms_lora_run_buffers(adapters, monkeypatch):
    """vLLM sizes the punica wrapper's per-run buffers for max_num_seqs runs (one per request: its
    model manager passes max_batches=max_num_seqs); a hand-over request in prefill is two runs (no
    adapter up to the hand-over point, then its adapter). A full batch of them must still fit: in an
    engine a misfit raises in update_metadata and kills the engine core."""
    max_num_seqs, prompt = 16, 6
    batch = InputBatch(max_num_reqs=max_num_seqs, max_model_len=64, max_num_batched_tokens=256,
                       device=torch.device("cpu"), vocab_size=1000, block_sizes=[16], max_num_blocks_per_req=[4])
    for i in range(max_num_seqs):
        batch.add_request(_state(f"r{i}", prompt, _lora(HANDOVER, 1)))
    scheduled = np.full(max_num_seqs, prompt, dtype=np.int32)
    prompt_ids, token_ids, _ = vllm_plugin._make_lora_inputs(batch, scheduled, np.ones(max_num_seqs, dtype=np.int32))
    assert list(token_ids) == ([0] * (prompt - 1) + [1]) * max_num_seqs
    # the wrapper as vLLM's model manager builds it, through the plugin's stand-in
    monkeypatch.setitem(vllm_plugin._VLLM, "get_punica_wrapper", model_manager.get_punica_wrapper)
    wrapper = vllm_plugin._punica_wrapper(256, max_batches=max_num_seqs, device="cpu", lora_config=None)
    assert isinstance(wrapper, punica_cpu.PunicaWrapperCPU)
    mapping = LoRAMapping(token_ids, prompt_ids, is_prefill=True)
    try:
        wrapper.update_metadata(mapping, [1, None], 2, 1000)
    except RuntimeError as e:
        pytest.fail(f"{max_num_seqs} hand-over requests in prefill are {2 * max_num_seqs} LoRA runs; "
                    f"vllm.lora.punica_wrapper.punica_base.PunicaWrapperBase holds {max_num_seqs}: {e}")
    assert wrapper.prefill_metadata[2].tolist() == [-1, 0] * max_num_seqs


def _keys(rid_lora: LoRARequest | None, n: int, start: int, end: int, salt: str | None = "tenant-a"):
    req = NS(request_id="r", lora_request=rid_lora, cache_salt=salt, num_prompt_tokens=n, mm_features=None,
             prompt_embeds=None)
    keys, mm = vllm_plugin._block_hash_extra_keys(req, start, end, 0)
    assert mm == 0
    return keys


def test_a_block_before_the_hand_over_point_loses_the_adapter_key_and_keeps_the_salt(adapters):
    h, lora_key = _lora(HANDOVER, 1), ("lora", HANDOVER, "/adapters/chat-h")
    # 12 prompt tokens: hand-over point 11
    assert _keys(h, 12, 0, 4) == (("cache_salt", "tenant-a"),)
    assert _keys(h, 12, 4, 8) is None  # the base's key of a later block
    assert _keys(h, 12, 0, 4, salt=None) is None
    assert _keys(h, 12, 8, 11) == _keys(h, 12, 7, 11) is None  # ends at the hand-over point: still the base's
    assert _keys(h, 12, 8, 12) == (lora_key,)  # holds the hand-over token: the adapter's
    assert _keys(h, 12, 12, 16) == (lora_key,)  # generated tokens
    assert _keys(h, 1, 0, 4) == (lora_key, ("cache_salt", "tenant-a"))  # a one-token prompt: no shared part
    o = _lora(OTHER, 2)
    assert _keys(o, 12, 0, 4) == (("lora", OTHER, "/adapters/chat-o"), ("cache_salt", "tenant-a"))
    assert _keys(o, 12, 4, 8) == (("lora", OTHER, "/adapters/chat-o"),)
    assert _keys(None, 12, 0, 4) == (("cache_salt", "tenant-a"),) and _keys(None, 12, 4, 8) is None


def test_a_hand_over_adapters_block_hashes_are_the_bases_up_to_the_hand_over_point(adapters, monkeypatch, none_hash):
    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", vllm_plugin._block_hash_extra_keys)
    hasher = kv_cache_utils.get_request_block_hasher(4, sha256)

    def hashes(n, lora=None, salt="tenant-a"):
        return _request("r", n, lora, salt, hasher).block_hashes

    h, o = _lora(HANDOVER, 1), _lora(OTHER, 2)
    base, adapter = hashes(12), hashes(12, h)  # hand-over point 11: in the third block
    assert len(base) == 3 and adapter[:2] == base[:2] and adapter[2] != base[2]
    base, adapter = hashes(13), hashes(13, h)  # hand-over point 12: after the third block
    assert len(base) == 3 and adapter == base
    assert not set(hashes(13, h, salt="tenant-b")) & set(base)  # another tenant shares nothing
    assert not set(hashes(13, o)) & set(base)  # an ordinary adapter keeps its own blocks


# --- Activated LoRA: the activation point is the start of the invocation's last occurrence -------------

def test_vllm_refuses_activated_lora_in_validate_legal_through_validate_features():
    """Stock: validate_legal (vLLM's load of every adapter) refuses aLoRA with the message
    _validate_features gives, the function the plugin replaces."""
    helper = peft_helper.PEFTHelper(r=8, lora_alpha=16, target_modules=["q_proj"], alora_invocation_tokens=list(INVOKE))
    stock = _vllms(VALIDATE, peft_helper.PEFTHelper, "_validate_features")
    assert any("Activated LoRA" in m for m in stock(helper)), f"{VALIDATE} no longer refuses aLoRA"
    assert "self._validate_features()" in inspect.getsource(peft_helper.PEFTHelper.validate_legal), (
        "vllm.lora.peft_helper.PEFTHelper.validate_legal no longer calls _validate_features")


def test_an_activated_lora_adapter_of_the_engine_loads_and_every_other_check_stays(adapters):
    ok = peft_helper.PEFTHelper(r=8, lora_alpha=16, target_modules=["q_proj"], alora_invocation_tokens=list(INVOKE))
    assert vllm_plugin._validate_features(ok) == [] and ok.alora_invocation_tokens == list(INVOKE)
    other = peft_helper.PEFTHelper(r=8, lora_alpha=16, target_modules=["q_proj"], alora_invocation_tokens=[9, 9])
    assert any("Activated LoRA" in m for m in vllm_plugin._validate_features(other))  # not this engine's
    dora = peft_helper.PEFTHelper(r=8, lora_alpha=16, target_modules=["q_proj"], alora_invocation_tokens=list(INVOKE),
                                  use_dora=True)
    assert vllm_plugin._validate_features(dora) == ["vLLM does not yet support DoRA."]


class AloraBatch(FakeBatch):
    """Requests of the Activated LoRA adapter (id 3) with their prompts in token_ids_cpu, as vLLM keeps them."""

    def __init__(self, prompts, computed, lora_ids):
        super().__init__([len(p) for p in prompts], computed, lora_ids)
        self.token_ids_cpu = np.zeros((len(prompts) + 1, 64), dtype=np.int32)
        for i, p in enumerate(prompts):
            self.token_ids_cpu[i, :len(p)] = p


def test_an_activated_lora_adapter_acts_from_its_invocations_last_occurrence():
    twice = [1, 7, 8, 2, 3, 7, 8, 4, 5]  # invoked at 1 and at 5: acts from 5 on
    once = [1, 2, 7, 8, 3]
    cases = [
        ([twice, once], [0, 0], [3, 3], [9, 5], [0] * 5 + [3] * 4 + [0, 0] + [3] * 3),
        ([twice], [3], [3], [4], [0, 0, 3, 3]),  # a chunk that reaches the point
        ([twice, once], [9, 5], [3, 3], [1, 1], [3, 3]),  # decode
        ([twice, once], [0, 0], [3, 1], [9, 5], [0] * 5 + [3] * 4 + [0] * 4 + [1]),  # beside a hand-over adapter
    ]
    for prompts, computed, lora_ids, scheduled, want in cases:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(vllm_plugin, "_ADAPTERS", {HANDOVER: Activation(), ALORA: Activation(INVOKE)})
            for label, owner, attr, _ in REPLACED:
                mp.setitem(vllm_plugin._VLLM, attr, _vllms(label, owner, attr))
            assert _ids(AloraBatch(prompts, computed, lora_ids), scheduled) == want, (prompts, computed)


def test_an_activated_lora_adapters_blocks_are_the_bases_before_its_invocation(adapters, monkeypatch, none_hash):
    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", vllm_plugin._block_hash_extra_keys)
    hasher = kv_cache_utils.get_request_block_hasher(4, sha256)
    a = _lora(ALORA, 3)

    def hashes(prompt, lora=None):
        return Request("r", prompt, SamplingParams(max_tokens=1), None, lora_request=lora, cache_salt="t",
                       block_hasher=hasher).block_hashes

    prompt = [*range(100, 110), *INVOKE, 200, 201]  # invoked at 10: blocks 0-4 and 4-8 the base's, 8-12 holds it
    base, adapter = hashes(prompt), hashes(prompt, a)
    assert len(base) == 3 and adapter[:2] == base[:2] and adapter[2] != base[2]
    early = [100, *INVOKE, *range(101, 110), 201]  # invoked at 1 only: the first block is the adapter's
    assert hashes(early, a)[0] != hashes(early)[0]
    again = [100, *INVOKE, *range(101, 108), *INVOKE, 201]  # and again at 10: the last occurrence counts
    assert hashes(again, a)[:2] == hashes(again)[:2]


# --- register() -----------------------------------------------------------------------------------

def test_register_without_hand_over_adapters_installs_nothing(monkeypatch):
    before = {label: _vllms(label, owner, attr) for label, owner, attr, _ in REPLACED}
    adapters_before = vllm_plugin.handover_adapters()
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv(HANDOVER_ADAPTERS_ENV, raising=False)
        else:
            monkeypatch.setenv(HANDOVER_ADAPTERS_ENV, value)
        vllm_plugin.register()
        assert {label: getattr(owner, attr) for label, owner, attr, _ in REPLACED} == before
        assert vllm_plugin.handover_adapters() == adapters_before


_REGISTER_CHILD = """
import json, sys
from types import SimpleNamespace as NS
from vllm.lora import model_manager, peft_helper
from vllm.lora.punica_wrapper import punica_cpu
from vllm.v1.core import block_pool, kv_cache_utils
from vllm.v1.worker.gpu_input_batch import InputBatch
owners = {"kv_cache_utils": kv_cache_utils, "block_pool": block_pool, "InputBatch": InputBatch,
          "punica_cpu": punica_cpu, "model_manager": model_manager, "PunicaWrapperCPU": punica_cpu.PunicaWrapperCPU,
          "PEFTHelper": peft_helper.PEFTHelper}
targets = json.loads(sys.argv[1])
stock = {label: getattr(owners[o], attr) for label, o, attr in targets}
from vllm.plugins import load_general_plugins
load_general_plugins()  # vLLM's own discovery of the entry point, as in each engine process
from prefillshare.app.engine import vllm_plugin as p
def state():
    return {label: [getattr(owners[o], attr).__module__ + "." + getattr(owners[o], attr).__qualname__,
                    p._VLLM.get(attr) is stock[label]] for label, o, attr in targets}
first = state()
p.register()  # vLLM loads plugins more than once per process
req = NS(lora_request=NS(lora_name="chat-a", lora_path="/a"), cache_salt=None, num_prompt_tokens=10,
         mm_features=None, prompt_embeds=None)
print(json.dumps({"first": first, "again": state(), "adapters": sorted(p.handover_adapters()),
                  "keys": [kv_cache_utils.generate_block_hash_extra_keys(req, 0, 4, 0)[0],
                           block_pool.generate_block_hash_extra_keys(req, 8, 12, 0)[0]]}))
"""


def test_register_with_hand_over_adapters_installs_every_replacement_through_vllms_plugin_loader():
    """In a fresh process (this one stays unpatched), as vLLM loads it in an engine's."""
    targets = [(label, {InputBatch: "InputBatch", punica_cpu.PunicaWrapperCPU: "PunicaWrapperCPU",
                        peft_helper.PEFTHelper: "PEFTHelper"}.get(
                owner, owner.__name__.rsplit(".", 1)[-1]), attr)
               for label, owner, attr, _ in REPLACED]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}  # no allow-list: every plugin installed
    env[HANDOVER_ADAPTERS_ENV] = vllm_plugin.adapters_env({"chat-a": Activation(), "chat-b": Activation((5, 6))})
    out = subprocess.run([sys.executable, "-c", _REGISTER_CHILD, json.dumps(targets)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = {label: [f"{vllm_plugin.__name__}.{ours.__name__}", True] for label, _, _, ours in REPLACED}
    assert got["first"] == want and got["again"] == want
    assert got["adapters"] == ["chat-a", "chat-b"]
    # installed and calling vLLM's own (no recursion): the early block is the base's, the one past it the adapter's
    assert got["keys"] == [None, [["lora", "chat-a", "/a"]]]
