"""The project's vLLM plugin: LoRA decoders that act from their activation point on, inside the base's engine.

An in-engine LoRA decoder is the base for every prompt token before its activation point and base +
adapter from there on (app/prompt_split.py: the hand-over point for the project's
cache-conditioned adapters, the last occurrence of the invocation sequence for PEFT's Activated
LoRA). vLLM 0.32 applies an adapter to every token of its request and keys every prefix-cache block
with it, has no hook to do otherwise, and refuses Activated LoRA adapters, so this module changes
vLLM's behaviour, and nothing else in the project does. It is vLLM's general plugin ``prefillshare``
(pyproject's ``vllm.general_plugins`` entry point), which vLLM loads in every process of an engine;
it acts only in an engine whose environment names its in-engine adapters
(:data:`HANDOVER_ADAPTERS_ENV`, a JSON object of LoRA name to invocation token ids, empty for the
hand-over point, set from ``EngineConfig.handover_adapters``). Stock engines, the benchmarks'
baselines included, run unchanged.

What it replaces, each wrapping or standing in for vLLM's own function (canary: tests/test_vllm_plugin.py, which fails
naming the function on a vLLM whose code changed):

- ``vllm.lora.peft_helper.PEFTHelper._validate_features``: an adapter whose
  ``alora_invocation_tokens`` are those of an in-engine adapter of this engine is not refused for
  them (every other check stays); any other Activated LoRA adapter still is.
- ``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys`` (and the name
  ``vllm.v1.core.block_pool`` imported, for KV events): a block that lies wholly before the request's
  activation point is keyed as the base's block (the adapter's key dropped; the tenant's salt stays),
  so the base and every in-engine adapter share it. A block that reaches the point keeps the adapter.
  The point is found once per request (an Activated LoRA prompt is searched once) and kept on it.
- ``vllm.v1.worker.gpu_input_batch.InputBatch.make_lora_inputs`` (the CPU model runner and vLLM's V1
  GPU runner share it; such an engine runs the V1 runner, :data:`HANDOVER_ENGINE_ENV`): a token before
  the activation point gets LoRA id 0 (no adapter). Only requests with prompt tokens in the step are
  looked at; a decode token is past any point (an Activated LoRA prompt without its invocation never
  reaches the engine: the engine refuses it, app/engine/async_engine.py).
- ``vllm.lora.model_manager.get_punica_wrapper``: vLLM sizes the LoRA wrapper's per-run buffers for
  ``max_num_seqs`` runs of tokens with one adapter, one per request; a hand-over request in prefill
  is two (no adapter, then its adapter), so the wrapper gets room for twice as many. Without it a
  full batch of such requests overflows the buffers and kills the engine core.
- ``vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU.add_lora_linear`` (CPU only): a LoRA linear
  layer's step. vLLM loops over the layer's slices (q, k, v; gate, up), two ops each, over every token.
  Here a step whose few tokens have an adapter (a decode token or a hand-over token per request) is one
  product each way for the whole layer, over those tokens only, against every slot's matrices side by
  side (kept per weights version), each token's row masked to its own slot; a token without an adapter
  keeps the base's output. A step with many adapter tokens goes to vLLM's loop.
- ``vllm.lora.punica_wrapper.punica_cpu``'s ``sgmv_shrink``, ``sgmv_expand`` and
  ``sgmv_expand_slice`` (CPU only; vLLM's loop calls them): vLLM's torch ops gather one adapter matrix
  per token and read a token without an adapter (index -1) as the last adapter slot, so in a batch that
  mixes base and adapter tokens the base tokens would get that slot's adapter, at an adapter's cost.
  They become one matrix product per run of tokens with the same adapter, and none for a run without one
  or whose slot's weights are all zero (vLLM also runs them for the embeddings' LoRA, every step, which
  the project's adapters leave zero).
- ``vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU.add_lora_logits`` (CPU only): the LM head's
  LoRA, which vLLM runs on every sampled row each step, reading a row without an adapter as the last
  slot's. Here only rows whose slot holds LM-head weights get a product; with adapters of attention
  and MLP none does, and nothing is computed.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from prefillshare.app.errors import PrefillShareLibraryError
from prefillshare.app.prompt_split import Activation, shared_length

__all__ = ["HANDOVER_ADAPTERS_ENV", "HANDOVER_ENGINE_ENV", "PluginNotActiveError", "adapters_env", "check_engine",
           "check_loadable", "handover_adapters", "register"]

HANDOVER_ADAPTERS_ENV = "PREFILLSHARE_HANDOVER_ADAPTERS"
# the rest of such an engine's env: vLLM's V1 model runner, whose InputBatch the CPU runner shares (on
# GPUs with Triton vLLM 0.32 picks its V2 runner, which keeps its LoRA ids elsewhere)
HANDOVER_ENGINE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}

_ADAPTERS: dict[str, Activation] = {}
_VLLM: dict[str, Any] = {}  # vLLM's own functions, by name


def handover_adapters() -> frozenset[str]:
    """The LoRA names this process's engine runs from their activation point on (empty: plugin idle)."""
    return frozenset(_ADAPTERS)


def adapters_env(activations: dict[str, Activation]) -> str:
    """:data:`HANDOVER_ADAPTERS_ENV`'s value for an engine's in-engine adapters."""
    return json.dumps({name: list(a.invocation_tokens) for name, a in sorted(activations.items())})


def register() -> None:
    """vLLM's entry point: install the replacements once per process, if the engine names adapters."""
    global _ADAPTERS
    named = os.environ.get(HANDOVER_ADAPTERS_ENV)
    if not named:
        return
    _ADAPTERS = {name: Activation(tuple(tokens)) for name, tokens in json.loads(named).items()}
    if _VLLM:
        return  # installed already (vLLM loads plugins more than once per process)
    from vllm.lora import model_manager, peft_helper
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.v1.core import block_pool, kv_cache_utils
    from vllm.v1.worker import gpu_input_batch

    _replace(peft_helper.PEFTHelper, "_validate_features", _validate_features)
    _replace(kv_cache_utils, "generate_block_hash_extra_keys", _block_hash_extra_keys)
    _replace(block_pool, "generate_block_hash_extra_keys", _block_hash_extra_keys)
    _replace(gpu_input_batch.InputBatch, "make_lora_inputs", _make_lora_inputs)
    _replace(model_manager, "get_punica_wrapper", _punica_wrapper)
    _replace(punica_cpu.PunicaWrapperCPU, "add_lora_linear", _add_lora_linear)
    _replace(punica_cpu.PunicaWrapperCPU, "add_lora_logits", _add_lora_logits)
    _replace(punica_cpu, "sgmv_shrink", _sgmv_shrink)
    _replace(punica_cpu, "sgmv_expand", _sgmv_expand)
    _replace(punica_cpu, "sgmv_expand_slice", _sgmv_expand_slice)


class PluginNotActiveError(PrefillShareLibraryError, RuntimeError):
    """An engine names hand-over adapters but vLLM would not run them through this plugin."""


PLUGIN_NAME = "prefillshare"  # the entry point's name (pyproject.toml)


def check_loadable(environ=os.environ) -> None:
    """Before an engine with hand-over adapters starts: vLLM must find and be allowed to load this
    plugin, else its adapters would run on every prompt token and the base's cache keys would lie."""
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == PLUGIN_NAME]
    if not found:
        raise PluginNotActiveError(f"vLLM's plugin entry point {PLUGIN_NAME!r} (group vllm.general_plugins) is not "
                                   "installed: install the project (pip install -e .) so vLLM loads app/engine/vllm_plugin.py")
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [a.strip() for a in allowed.split(",")]:
        raise PluginNotActiveError(f"VLLM_PLUGINS={allowed!r} leaves out {PLUGIN_NAME!r}: in-engine LoRA decoders need it")


def check_engine(vllm_config) -> None:
    """Once an engine with hand-over adapters is built: it runs vLLM's V1 model runner, whose input
    batch the plugin masks (a config that forces the V2 runner would apply adapters everywhere)."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise PluginNotActiveError("the engine runs vLLM's V2 model runner (a setting forces it over "
                                   "VLLM_USE_V2_MODEL_RUNNER=0): in-engine LoRA decoders need the V1 runner")


def _replace(owner, name: str, replacement) -> None:
    """Keep vLLM's function (by name: block_pool's import is kv_cache_utils' own), put ours in its place."""
    _VLLM.setdefault(name, getattr(owner, name))
    setattr(owner, name, replacement)


# --- loading: Activated LoRA adapters this engine serves in-engine --------------------------------

def _validate_features(self) -> list[str]:
    tokens = self.alora_invocation_tokens
    if not tokens or Activation(tuple(int(t) for t in tokens)) not in _ADAPTERS.values():
        return _VLLM["_validate_features"](self)
    self.alora_invocation_tokens = None  # vLLM's other checks, without the one this plugin answers
    try:
        return _VLLM["_validate_features"](self)
    finally:
        self.alora_invocation_tokens = tokens


# --- scheduler side: prefix-cache keys -------------------------------------------------------------

_START = "_prefillshare_activation_start"  # set on a vLLM Request: its activation point, found once
NOWHERE = 1 << 62  # the start of an Activated LoRA prompt without its invocation: no token gets the adapter


def _request_start(request, activation: Activation) -> int:
    if not activation.is_alora:
        return shared_length(request.num_prompt_tokens)
    start = getattr(request, _START, None)
    if start is None:
        found = activation.start(request.prompt_token_ids)
        start = NOWHERE if found is None else found
        setattr(request, _START, start)
    return start


def _block_hash_extra_keys(request, start_token_idx: int, end_token_idx: int, start_mm_idx: int):
    keys, next_mm_idx = _VLLM["generate_block_hash_extra_keys"](request, start_token_idx, end_token_idx,
                                                                 start_mm_idx)
    lora = request.lora_request
    activation = None if lora is None else _ADAPTERS.get(lora.lora_name)
    if keys is not None and activation is not None and end_token_idx <= _request_start(request, activation):
        keys = tuple(k for k in keys if k[0] != "lora") or None
    return keys, next_mm_idx


# --- worker side: which tokens an adapter acts on --------------------------------------------------

def _make_lora_inputs(self, num_scheduled_tokens: np.ndarray, num_sampled_tokens: np.ndarray):
    prompt_mapping, token_mapping, requests = _VLLM["make_lora_inputs"](self, num_scheduled_tokens,
                                                                       num_sampled_tokens)
    by_id = {i: _ADAPTERS[r.lora_name] for i, r in self.lora_id_to_lora_request.items() if r.lora_name in _ADAPTERS}
    if not by_id:
        return prompt_mapping, token_mapping, requests
    n = self.num_reqs
    counts = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
    computed, prompts = self.num_computed_tokens_cpu[:n], self.num_prompt_tokens[:n]
    # requests of an in-engine adapter with prompt tokens in this step: the only ones with tokens before a point
    rows = [i for i in np.flatnonzero((computed < prompts) & (counts > 0)).tolist()
            if int(self.request_lora_mapping[i]) in by_id]
    if not rows:
        return prompt_mapping, token_mapping, requests
    ids = np.asarray(token_mapping, dtype=np.int64)
    firsts = np.cumsum(counts) - counts
    for i in rows:
        activation = by_id[int(self.request_lora_mapping[i])]
        prompt = int(prompts[i])
        start = activation.start(self.token_ids_cpu[i, :prompt]) if activation.is_alora else shared_length(prompt)
        # the step's tokens of this request sit at positions computed[i] .. computed[i] + counts[i]
        before = min(max((NOWHERE if start is None else start) - int(computed[i]), 0), int(counts[i]))
        ids[firsts[i]: firsts[i] + before] = 0
    return prompt_mapping, tuple(ids.tolist()), requests


def _punica_wrapper(*args, **kwargs):
    """vLLM's LoRA wrapper with room for two runs per request (base part, adapter part); vLLM's model
    manager passes ``max_batches`` (its max_num_seqs) by keyword."""
    return _VLLM["get_punica_wrapper"](*args, **{**kwargs, "max_batches": 2 * kwargs["max_batches"]})


# --- CPU LoRA ops ---------------------------------------------------------------------------------
# A LoRA linear layer's step (PunicaWrapperCPU.add_lora_linear), where few of the step's tokens have
# an adapter (in-engine decoders: a decode token or a hand-over token per request): the layer's
# slices (q, k, v; gate, up) as one product each way, over the tokens with an adapter only, against
# every slot's matrix side by side, each token's row masked to its own slot. vLLM's per-slice loop of
# per-run ops (below) takes the rest: a step with many adapter tokens, where one product per run
# costs less than a product with every slot.

FUSED_MAX_ROWS = 4096  # tokens with an adapter x adapter slots, past which the per-run ops are cheaper


def _step_key(*tensors) -> tuple:
    """What a step's metadata is, across the fresh views of its buffers that vLLM's wrapper hands out
    on every call (``buf[:n]``): a view shares its buffer's address and version counter, and vLLM
    refills a buffer in place when the step's mapping changes, which bumps the version. Whoever caches
    by it holds the tensors, so no other tensor can take that address meanwhile."""
    return tuple((t.data_ptr(), t._version, t.numel()) for t in tensors)


class _Step:
    """One step's tokens with an adapter, read once per step from the wrapper's per-token slot indices."""

    __slots__ = ("indices", "key", "count", "every", "sel", "rows", "_masks")

    def __init__(self, indices):
        import torch

        self.indices, self.key = indices, _step_key(indices)
        sel = torch.nonzero(indices >= 0).squeeze(1)
        self.count = int(sel.numel())
        self.every = self.count == int(indices.numel())
        self.sel, self.rows = sel, indices[sel].long()
        self._masks: dict[tuple[int, int, Any], Any] = {}

    def mask(self, slots: int, block: int, dtype):
        """(token, slots * block): ones over each token's own slot's block, zeros elsewhere."""
        m = self._masks.get((slots, block, dtype))
        if m is None:
            import torch

            m = torch.zeros(self.count, slots, block, dtype=dtype)
            m[torch.arange(self.count), self.rows] = 1
            m = self._masks[(slots, block, dtype)] = m.view(self.count, slots * block)
        return m


_STEP: list[_Step | None] = [None]


def _step(indices) -> _Step:
    step = _STEP[0]
    if step is None or step.key != _step_key(indices):
        step = _STEP[0] = _Step(indices)
    return step


class _Fused:
    """A layer's adapter weights over every slot as two matrices in the weights' dtype (the products
    read every slot's weights, so their size is the cost; vLLM's own expand also runs in that dtype),
    slot-major: ``a`` (in, slots * S * r), every slice's A side by side, and ``b`` (slots * S * r, W),
    each slice's B in its own output columns (W: the layer's output width). A token's shrunk row masked to its own slot,
    times ``b``, is its adapter's output. Rebuilt when vLLM writes an adapter into a slot (the
    weights' versions change)."""

    __slots__ = ("weights", "versions", "a", "b", "slots", "block", "width")

    def __init__(self, lora_a, lora_b, output_slices):
        import torch

        self.weights, self.versions = (*lora_a, *lora_b), _versions(*lora_a, *lora_b)
        a = torch.stack([_stacked(w) for w in lora_a], 1)  # (slots, S, r, in)
        slots, n_slices, rank, cols = a.shape
        self.slots, self.block = slots, n_slices * rank
        self.a = a.permute(3, 0, 1, 2).reshape(cols, slots * self.block).contiguous()
        self.width = width = sum(output_slices)
        b = torch.zeros(slots, n_slices, rank, width, dtype=a.dtype)
        offset = 0
        for s, (w, size) in enumerate(zip(lora_b, output_slices)):
            b[:, s, :, offset: offset + size] = _stacked(w)[:, :size].transpose(1, 2)  # (slots, r, out)
            offset += size
        self.b = b.view(slots * self.block, width)


_FUSED: dict[tuple[int, ...], _Fused] = {}


def _fused(lora_a, lora_b, output_slices) -> _Fused:
    weights = (*lora_a, *lora_b)
    hit = _FUSED.get(key := tuple(map(id, weights)))
    if hit is None or any(a is not b for a, b in zip(hit.weights, weights)) or hit.versions != _versions(*weights):
        hit = _FUSED[key] = _Fused(lora_a, lora_b, output_slices)
    return hit


def _add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
    """y[token, :W] += scale * x[token] @ A[slot] @ B[slot], slices side by side, for each token with
    an adapter; a token without one (slot -1) is left as the base computed it."""
    if self.no_lora:
        return None
    step = _step(self.token_lora_indices)
    if step.count == 0:
        return None
    if step.count * lora_a_stacked[0].shape[0] > FUSED_MAX_ROWS or kwargs.get("add_inputs", True) is False:
        return _VLLM["add_lora_linear"](self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                                        buffer=buffer, **kwargs)
    f = _fused(lora_a_stacked, lora_b_stacked, output_slices)
    x2, y2, k = x.view(-1, x.shape[-1]), y.view(-1, y.shape[-1]), step.count
    tokens = x2[:k] if step.every else x2.index_select(0, step.sel)
    h = (tokens.to(f.a.dtype) @ f.a).mul_(step.mask(f.slots, f.block, f.a.dtype))  # each token's own slot only
    if scale != 1.0:
        h.mul_(scale)
    delta = (h @ f.b).to(y2.dtype)
    if step.every:
        y2[:k, : f.width] += delta
    else:
        y2[:, : f.width].index_add_(0, step.sel, delta)
    return None


def _add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
    """The LM head's LoRA: y[row] += scale * x[row] @ A[slot] @ B[slot] for each sampled row whose slot
    holds LM-head weights. vLLM wraps the head in every LoRA engine and runs it on every row each step
    (its ops read a row without an adapter as the last slot's); adapters of attention and MLP leave
    every slot zero there, and then nothing is computed."""
    live = _live(lora_b_stacked)
    if not live:
        return None
    y2, x2, slots = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1]), self.sampler_indices
    a, b = _stacked(lora_a_stacked), _stacked(lora_b_stacked)
    for slot in live:
        rows = _nonzero(slots == slot)
        if rows.numel():
            h = (x2.index_select(0, rows).float() @ a[slot].float().T) * scale
            y2.index_add_(0, rows, (h @ b[slot].float().T).to(y2.dtype))
    return None


def _nonzero(mask):
    import torch

    return torch.nonzero(mask).squeeze(1)


# An adapter slot whose weights are all zero (a slot not loaded, or a module the adapter does not
# target: vLLM wraps the embeddings and the LM head too) adds nothing: by weights identity and version.
_LIVE: dict[int, tuple[Any, int, frozenset[int]]] = {}


def _live(weights) -> frozenset[int]:
    """The slots of ``weights`` (slots, ...) holding any non-zero weight."""
    hit = _LIVE.get(id(weights))
    if hit is not None and hit[0] is weights and hit[1] == weights._version:
        return hit[2]
    live = frozenset(int(i) for i in _nonzero(weights.reshape(weights.shape[0], -1).ne(0).any(1)).tolist())
    _LIVE[id(weights)] = (weights, weights._version, live)
    return live


# vLLM's per-slice ops, for a step with many adapter tokens and for the embeddings' LoRA: one product
# per run of tokens with the same adapter, none for a run without one or whose slot is all zeros
# (vLLM's own gather one adapter matrix per token, and read a token without an adapter, index -1, as
# the last adapter slot).

class _Runs:
    """One step's runs of tokens with one adapter, as Python slices, read once per step, not once per
    op (every op of a step gets views of the same metadata buffers: :func:`_step_key`)."""

    __slots__ = ("tensors", "key", "runs")

    def __init__(self, starts, lengths, indices):
        self.tensors, self.key = (starts, lengths, indices), _step_key(starts, lengths, indices)
        s, n, i = starts.tolist(), lengths.tolist(), indices.tolist()
        self.runs = [(slice(a, a + b), c) for a, b, c in zip(s, n, i)]


_RUNS: list[_Runs | None] = [None]


def _versions(*tensors) -> tuple[int, ...]:
    return tuple(t._version for t in tensors)  # bumped by every in-place write


def _runs(starts, lengths, indices) -> _Runs:
    runs = _RUNS[0]
    if runs is None or runs.key != _step_key(starts, lengths, indices):
        runs = _RUNS[0] = _Runs(starts, lengths, indices)
    return runs


def _stacked(weights):
    return weights.squeeze(1) if weights.dim() == 4 else weights  # (n, 1, out, in) slots -> (n, out, in)


def _sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                 batches, max_seq_length, token_nums, scaling):
    runs, w, dtype = _runs(b_seq_start_loc, seq_len_tensor, lora_indices_tensor), _stacked(lora_a_weights), output_tensor.dtype
    live = _live(lora_a_weights)
    for rows, index in runs.runs:
        if index not in live:
            output_tensor[rows] = 0
            continue
        wi = w[index].to(dtype)
        output_tensor[rows, : wi.shape[0]] = scaling * (inputs[rows].to(dtype) @ wi.T)


def _sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                 batches, max_seq_length, token_nums, add_inputs=False):
    _expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
            0, None, add_inputs)


def _sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                       lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset, slice_size,
                       add_inputs=False):
    _expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
            slice_offset, slice_size, add_inputs)


def _expand(inputs, weights, output, starts, lengths, indices, offset: int, size: int | None, add: bool):
    runs, w, live = _runs(starts, lengths, indices), _stacked(weights), _live(weights)
    width = min(w.shape[1], output.shape[1] - offset) if size is None else size
    end = output.shape[1] if size is None else offset + size  # what a token without an adapter has zeroed
    for rows, index in runs.runs:
        if index not in live:
            if not add:
                output[rows, offset: end] = 0
            continue
        product = inputs[rows].to(output.dtype) @ w[index, :width].to(output.dtype).T
        if add:
            output[rows, offset: offset + width] += product
        else:
            output[rows, offset: offset + width] = product
