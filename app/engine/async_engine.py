"""One async vLLM engine wrapper, used by prefill and decode servers alike.

API (everything a server needs; nothing here knows about Ray):

    cfg = EngineConfig(model="checkpoints/base", dtype="float32", kv_cache_memory_bytes=1 << 30,
                       max_model_len=1024, block_size=32, max_num_batched_tokens=256,
                       extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, enforce_eager=True,
                       kv_transfer_config=handover.transfer_config("producer", link))  # prefillshare.app.engine.handover
    engine = await Engine.start(cfg)              # or Engine(cfg) from sync code (blocks ~20-50 s)
    async for out in engine.generate(ids, Sampling(max_tokens=16), "req-1", cache_salt="tenant-a"):
        out.new_token_ids, out.new_text, out.finish_reason, out.finished,
        out.num_prompt_tokens, out.num_cached_tokens, out.kv_transfer_params    # deltas, one per step
    done = await engine.complete(ids, Sampling(max_tokens=16))   # done.token_ids, done.text: the whole output
    res = await engine.prefill(ids, "req-2", cache_salt="tenant-a", kv_transfer_params={"fanout": 3})
    res.num_prompt_tokens, res.num_cached_tokens, res.num_computed_tokens
    await engine.check_health()                   # raises EngineError if the core is dead / stuck
    engine.shutdown()                             # idempotent; kills the engine-core process

Errors: every failure of the engine (dead core, bad request, timeout) surfaces as
:class:`EngineError` (``EngineRequestError`` for a rejected request), never as a hang: each
request runs under ``request_timeout_s``.

An engine's ``kv_transfer_config`` (its KV connector) comes from the app's hand-over
(:mod:`prefillshare.app.engine.handover`); this wrapper passes it to vLLM as is.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefillshare.app.bad_words import PROCESSOR as BAD_WORDS_PROCESSOR
from prefillshare.app.config import EngineSettings, LimitsConfig, LoRAGroup, default
from prefillshare.app.engine import alloc_conf, compute_dtype, core_lifetime, niceness, vllm_plugin
from prefillshare.app.engine.handover import KV_ROLE
from prefillshare.app.errors import PrefillShareLibraryError
from prefillshare.app.prompt_split import Activation
from prefillshare.app.sampling import Sampling, TokenLogprob, prompt_logprobs, to_sampling_params, token_logprobs

__all__ = [
    "EngineConfig",
    "Sampling",
    "EngineOutput",
    "Completion",
    "PrefillResult",
    "Engine",
    "EngineError",
    "EngineRequestError",
]


_ENV_LOCK = threading.Lock()


class EngineError(PrefillShareLibraryError, RuntimeError):
    """The engine failed (dead core, internal error, timeout)."""


class EngineRequestError(EngineError, ValueError):
    """The engine rejected a request (bad prompt, too long, bad sampling)."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to start one engine. Validated on construction.

    Fields named as vLLM's ``AsyncEngineArgs`` are passed to it under that name (:meth:`engine_args`);
    ``engine_kwargs`` carries any other engine argument through verbatim. The app fills this from
    serve_config.yaml in one place (app/engine_args.py); a field that is also a setting there takes
    that setting's default (app/config.py), so an engine built without a config runs as the app's."""

    model: str
    dtype: str = default(EngineSettings, "dtype")  # prefillshare.app.engine.compute_dtype: bf16 where native, else float32
    kv_cache_memory_bytes: int = default(EngineSettings, "kv_cache_memory_bytes")
    # GPUs only: vLLM refuses to start unless this fraction of the device is free; the KV size is
    # kv_cache_memory_bytes regardless. Lower it to put several engines on one GPU. None: vLLM's default.
    gpu_memory_utilization: float | None = default(EngineSettings, "gpu_memory_utilization")
    max_model_len: int = default(EngineSettings, "max_model_len")
    block_size: int = default(EngineSettings, "block_size")
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = default(EngineSettings, "max_num_seqs")
    enforce_eager: bool = default(EngineSettings, "enforce_eager")
    # None: on, except for PrefillShare consumers (their local cache could hold KV they computed
    # themselves after a fallback, breaking the hand-over convention on a later request).
    enable_prefix_caching: bool | None = None
    kv_transfer_config: dict[str, Any] | None = None
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    tokenizer: str | None = None
    seed: int = default(EngineSettings, "seed")
    request_timeout_s: float = default(LimitsConfig, "request_timeout_s")
    # env of the engine core, e.g. VLLM_CPU_OMP_THREADS_BIND ("0", "0-1", "nobind", "auto")
    extra_env: dict[str, str] = field(default_factory=dict)
    # Structured outputs run on xgrammar (the backend the Router validates schemas with); compact:
    # JSON without free whitespace, which a weak decoder could otherwise repeat until max_tokens.
    compact_json: bool = True
    # LoRA: (name, adapter directory) pairs the engine serves over ``model``; a request names one
    # (``lora=``) or none (the base). vLLM salts prefix-cache blocks per adapter.
    lora_adapters: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int | None = default(LoRAGroup, "max_lora_rank")  # with adapters; None: vLLM's default
    max_loras: int | None = None  # None: as many as lora_adapters; also vLLM's max_cpu_loras (all stay loaded)
    # names among lora_adapters that act from their activation point on (in-engine LoRA decoders: the base's
    # prefix cache and base tokens before that point; app/prompt_split.py, app/engine/vllm_plugin.py)
    handover_adapters: tuple[str, ...] = ()
    # any other AsyncEngineArgs field, passed through as given (serve_config.yaml's engine.engine_kwargs)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # niceness of the engine core's processes once the engine answers (0: left as spawned), so that an
    # engine starting on the same cores comes first (app/engine/niceness.py)
    serving_niceness: int = default(EngineSettings, "serving_niceness")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("EngineConfig.model: a model path is required")
        if self.load_format != "dummy" and not os.path.isdir(self.model):
            raise ValueError(f"EngineConfig.model: {self.model!r} is not a directory")
        if self.dtype not in compute_dtype.DTYPES:
            raise ValueError(f"EngineConfig.dtype: unsupported {self.dtype!r}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("EngineConfig.kv_cache_memory_bytes must be > 0")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("EngineConfig.gpu_memory_utilization must be in (0, 1]")
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError("EngineConfig.block_size must be a positive multiple of 16")
        if self.max_model_len <= 1:
            raise ValueError("EngineConfig.max_model_len must be > 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            raise ValueError("EngineConfig.max_num_batched_tokens must be >= block_size")
        if self.request_timeout_s <= 0:
            raise ValueError("EngineConfig.request_timeout_s must be > 0")
        if not 0 <= self.serving_niceness <= 19:
            raise ValueError("EngineConfig.serving_niceness must be in [0, 19]")
        if self.kv_transfer_config is not None and not isinstance(self.kv_transfer_config, dict):
            raise ValueError("EngineConfig.kv_transfer_config must be a dict")
        if self.max_loras is None:
            object.__setattr__(self, "max_loras", max(1, len(self.lora_adapters)))
        if len(self.lora_adapters) > (self.max_loras or 1):
            raise ValueError(f"EngineConfig.lora_adapters: {len(self.lora_adapters)} adapters, max_loras is "
                             f"{self.max_loras}")
        unknown = sorted(set(self.handover_adapters) - {name for name, _ in self.lora_adapters})
        if unknown:
            raise ValueError(f"EngineConfig.handover_adapters: {unknown} are not among lora_adapters")
        activated = [name for name, path in self.lora_adapters
                     if name not in self.handover_adapters and Activation.of_adapter(path).is_alora]
        if activated:
            raise ValueError(f"EngineConfig.lora_adapters: {activated} are Activated LoRA adapters "
                             "(alora_invocation_tokens): serve them in-engine, as handover_adapters "
                             "(a prefill module's lora_decoders)")
        if self.is_consumer and self.enable_prefix_caching:
            raise ValueError("EngineConfig.enable_prefix_caching must be off for a PrefillShare consumer "
                             "(its local cache may hold its own KV after a fallback)")

    @property
    def is_consumer(self) -> bool:
        """The engine reads another engine's KV (vLLM's own ``kv_role``, whatever the connector)."""
        return (self.kv_transfer_config or {}).get("kv_role") == KV_ROLE["consumer"]

    @property
    def activations(self) -> dict[str, Activation]:
        """Each in-engine adapter's activation rule, as its directory states it."""
        paths = dict(self.lora_adapters)
        return {name: Activation.of_adapter(paths[name]) for name in self.handover_adapters}

    @property
    def core_env(self) -> dict[str, str]:
        """The engine core's env: ``extra_env``, and the in-engine adapters vLLM's plugin reads."""
        if not self.handover_adapters:
            return dict(self.extra_env)
        return {**self.extra_env, vllm_plugin.HANDOVER_ADAPTERS_ENV: vllm_plugin.adapters_env(self.activations),
                **vllm_plugin.HANDOVER_ENGINE_ENV}

    @property
    def prefix_caching(self) -> bool:
        if self.enable_prefix_caching is None:
            return not self.is_consumer
        return self.enable_prefix_caching

    def engine_args(self):
        """The vLLM ``AsyncEngineArgs`` for this config."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        mnbt = self.max_num_batched_tokens
        kw: dict[str, Any] = dict(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=compute_dtype.resolve(self.dtype),
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            enable_prefix_caching=self.prefix_caching,
            enforce_eager=self.enforce_eager,
            load_format=self.load_format,
            skip_tokenizer_init=self.skip_tokenizer_init,
            seed=self.seed,
            max_num_seqs=self.max_num_seqs,
            kv_cache_memory_bytes=int(self.kv_cache_memory_bytes),
            disable_log_stats=False,
        )
        if self.gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        from vllm.config import StructuredOutputsConfig

        kw["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar",
                                                                  disable_any_whitespace=self.compact_json)
        if self.lora_adapters:
            kw.update(enable_lora=True, max_loras=self.max_loras, max_cpu_loras=self.max_loras)
            if self.max_lora_rank is not None:
                kw["max_lora_rank"] = self.max_lora_rank
        if mnbt is not None:
            kw["max_num_batched_tokens"] = mnbt
            kw["enable_chunked_prefill"] = True
        if self.kv_transfer_config is not None:
            from vllm.config import KVTransferConfig

            kw["kv_transfer_config"] = KVTransferConfig(**self.kv_transfer_config)
        extra = dict(self.engine_kwargs)
        # bad_words in every form (app/bad_words.py), beside any processors of the user's own
        kw["logits_processors"] = [BAD_WORDS_PROCESSOR, *(extra.pop("logits_processors", None) or ())]
        clash = sorted(set(extra) & set(kw))
        if clash:
            raise ValueError(f"EngineConfig.engine_kwargs: {clash} are set from EngineConfig's own fields")
        return AsyncEngineArgs(**kw, **extra)


@dataclass
class EngineOutput:
    """One streamed step of one of a request's sequences (``index``, 0 unless ``n`` > 1): what
    this step added, never the whole output so far (callers accumulate what they keep)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # the text this step added ("" without a tokenizer)
    finished: bool  # the request (every sequence) is done
    finish_reason: str | None  # set when this sequence is done
    num_prompt_tokens: int
    num_cached_tokens: int  # local prefix-cache hits + KV loaded through the connector
    kv_transfer_params: dict[str, Any] | None = None
    index: int = 0
    new_logprobs: list[TokenLogprob] | None = None  # when the sampling asked for logprobs
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, when the sampling asked for them


@dataclass
class Completion:
    """A request run to its end (:meth:`Engine.complete`): the whole output of the sequence
    that finished last (index 0 unless ``n`` > 1)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    stop_reason: str | int | None = None


@dataclass
class PrefillResult:
    """What a prefill-only request (max_tokens=1) did."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    kv_transfer_params: dict[str, Any] | None = None


# The pool's one typed config lives with the pool (defaults, validation); re-exported here.


@contextlib.contextmanager
def _engine_env(cfg: EngineConfig):
    """Env the spawned engine-core process inherits; restored afterwards.

    VLLM_CPU_KVCACHE_SPACE would override ``kv_cache_memory_bytes`` (vLLM's legacy setting),
    so it is removed while the engine is built.
    """
    want = cfg.core_env
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and all(os.environ.get(k) == v for k, v in want.items()):
        yield  # nothing to change: engines can start concurrently
        return
    with _ENV_LOCK:
        saved = dict(os.environ)
        try:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            os.environ.update(want)
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)


_REAP_TIMEOUT_S = 10.0
_STAT_LOGGER_LOCK = threading.Lock()


@functools.cache
def _prometheus_stat_logger():
    """vLLM's Prometheus stat logger, built under a process-wide lock. Its constructor first
    unregisters every ``vllm:*`` collector of the default registry and then registers its own, so
    two engines built at once in one process (threads of ``Engine.start``) can interleave and fail
    the later start with DuplicateTimeseries (seen in CI: 1 of 5 concurrent starts); so can the
    cache-config info gauge it registers once its engine is up (seen with the worker in the engine
    core, whose starts are shorter). As with vLLM alone, the engine built last owns the process's
    ``vllm:*`` series."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class LockedPrometheusStatLogger(PrometheusStatLogger):
        def __init__(self, *args, **kwargs):
            with _STAT_LOGGER_LOCK:
                super().__init__(*args, **kwargs)

        def log_engine_initialized(self):
            # Registers vllm:cache_config_info once the engine is up; an engine of this process that
            # came up first has registered it already (DuplicateTimeseries), so it is replaced.
            from prometheus_client import REGISTRY

            with _STAT_LOGGER_LOCK:
                for collector, names in list(REGISTRY._collector_to_names.items()):
                    if "vllm:cache_config_info" in names:
                        REGISTRY.unregister(collector)
                super().log_engine_initialized()

    return LockedPrometheusStatLogger


def _core_processes(llm) -> list:
    """The engine-core processes vLLM started for ``llm`` (its process manager's; none in-process)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    return list(getattr(getattr(resources, "engine_manager", None), "processes", None) or [])


def _outputs(out, rid: str, ids: list[int], params) -> Iterator[EngineOutput]:
    """One engine step's DELTA outputs (each sequence's new tokens and text) as EngineOutputs."""
    plps = None
    if params.prompt_logprobs is not None and out.prompt_logprobs:
        plps = prompt_logprobs(out.prompt_token_ids or ids, out.prompt_logprobs, params.prompt_logprobs)
    for j, comp in enumerate(out.outputs):
        new = list(comp.token_ids)
        yield EngineOutput(
            request_id=rid,
            new_token_ids=new,
            new_text=comp.text or "",
            finished=out.finished and j == len(out.outputs) - 1,
            finish_reason=comp.finish_reason,
            num_prompt_tokens=len(out.prompt_token_ids or ids),
            num_cached_tokens=int(out.num_cached_tokens or 0),
            kv_transfer_params=out.kv_transfer_params,
            index=comp.index,
            new_logprobs=(token_logprobs(new, comp.logprobs, params.logprobs)
                          if params.logprobs is not None else None),
            stop_reason=comp.stop_reason,
            prompt_logprobs=plps if j == 0 else None,
        )


class Engine:
    """An ``AsyncLLM`` with typed inputs and outputs and errors that surface."""

    def __init__(self, cfg: EngineConfig):
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cfg = cfg
        self._closed = False
        self.queued_prompt_tokens = 0  # prompt tokens of requests with no output yet (the autoscaler's queue signal)
        self._loras = {}
        if cfg.lora_adapters:
            from vllm.lora.request import LoRARequest

            self._loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(cfg.lora_adapters)}
        # Activated LoRA adapters: a prompt without the invocation sequence is refused here, before vLLM
        self._invoked = {name: a for name, a in cfg.activations.items() if a.is_alora}
        core_lifetime.install()  # the engine core dies with this process, even by SIGKILL
        with _engine_env(cfg):
            try:
                self._llm = AsyncLLM.from_engine_args(cfg.engine_args(), stat_loggers=[_prometheus_stat_logger()])
            except Exception as e:  # noqa: BLE001 - startup failures of any kind
                raise EngineError(f"engine for {cfg.model!r} failed to start: {e}") from e
            if cfg.handover_adapters:  # read under the engine's env, as its core read it
                try:
                    vllm_plugin.check_engine(self._llm.vllm_config)
                except vllm_plugin.PluginNotActiveError as e:
                    self.shutdown()
                    raise EngineError(f"engine for {cfg.model!r}: {e}") from None

    @classmethod
    async def start(cls, cfg: EngineConfig) -> Engine:
        """Build the engine without blocking the event loop; LoRA adapters are loaded before it
        answers (a bad adapter fails the start, not a request). An allocator setting vLLM would
        refuse beside a KV connector fails here, typed (``alloc_conf.ExpandableSegmentsError``)."""
        alloc_conf.check({**os.environ, **cfg.extra_env}, cfg.kv_transfer_config, cfg.engine_kwargs)
        if cfg.handover_adapters:
            try:
                vllm_plugin.check_loadable({**os.environ, **cfg.core_env})
            except vllm_plugin.PluginNotActiveError as e:
                raise EngineError(f"engine for {cfg.model!r}: {e}") from None
        engine = await asyncio.to_thread(cls, cfg)
        for name, req in engine._loras.items():
            try:
                await engine._llm.add_lora(req)
            except Exception as e:  # noqa: BLE001 - any load failure names the adapter
                engine.shutdown()
                raise EngineError(f"LoRA adapter {name!r} ({req.lora_path}) failed to load: {e}") from e
        if cfg.serving_niceness:
            for proc in _core_processes(engine._llm):
                niceness.renice_tree(proc.pid, cfg.serving_niceness)
        return engine

    def lora_request(self, name: str | None):
        """vLLM's LoRARequest for adapter ``name`` (None: the base model)."""
        if name is None:
            return None
        try:
            return self._loras[name]
        except KeyError:
            raise EngineRequestError(f"model: {name!r} is not an adapter of this engine "
                                     f"(have {sorted(self._loras)})") from None

    def _check_alive(self) -> None:
        if self._closed or self._llm is None:
            raise EngineError("engine is shut down")
        if self._llm.errored:
            raise EngineError(f"engine is dead: {self._llm.dead_error}")

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling | Any,
        request_id: str | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Stream a request's outputs, one per sequence and step. ``sampling`` is a
        :class:`prefillshare.app.sampling.Sampling` or vLLM ``SamplingParams``."""
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        self._check_alive()
        lora_request = self.lora_request(lora)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise EngineRequestError("prompt_token_ids is empty")
        if lora in self._invoked:
            self._invoked[lora].check(lora, ids)
        if len(ids) >= self.cfg.max_model_len:
            raise EngineRequestError(
                f"prompt_token_ids: {len(ids)} tokens, max_model_len is {self.cfg.max_model_len}"
            )
        params = to_sampling_params(sampling) if isinstance(sampling, Sampling) else sampling
        if kv_transfer_params:
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": dict(kv_transfer_params)}
        rid = request_id or uuid.uuid4().hex
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        agen = self._llm.generate(prompt, params, rid, lora_request=lora_request)
        deadline = asyncio.get_running_loop().time() + self.cfg.request_timeout_s
        queued = len(ids)
        self.queued_prompt_tokens += queued
        try:
            while True:
                left = deadline - asyncio.get_running_loop().time()
                try:
                    out = await asyncio.wait_for(agen.__anext__(), timeout=max(left, 0.001))
                except StopAsyncIteration:
                    return
                except TimeoutError as e:
                    raise EngineError(f"request {rid} timed out after {self.cfg.request_timeout_s}s") from e
                self.queued_prompt_tokens -= queued
                queued = 0
                for output in _outputs(out, rid, ids, params):
                    yield output
                if out.finished:
                    return
        except EngineDeadError as e:
            raise EngineError(f"engine died during request {rid}: {e}") from e
        except (VLLMValidationError, ValueError) as e:
            if isinstance(e, EngineError):
                raise
            raise EngineRequestError(f"request {rid} rejected: {e}") from e
        except EngineGenerateError as e:
            raise EngineError(f"request {rid} failed: {e.__cause__ or e}") from e
        finally:
            self.queued_prompt_tokens -= queued
            with contextlib.suppress(Exception):
                await agen.aclose()

    async def complete(self, prompt_token_ids, sampling, request_id=None, cache_salt=None,
                       kv_transfer_params=None, lora=None) -> Completion:
        """Run a request to the end; the whole output of its last sequence to finish."""
        last = None
        ids: dict[int, list[int]] = {}
        texts: dict[int, list[str]] = {}
        async for out in self.generate(prompt_token_ids, sampling, request_id, cache_salt, kv_transfer_params, lora):
            ids.setdefault(out.index, []).extend(out.new_token_ids)
            texts.setdefault(out.index, []).append(out.new_text)
            last = out
        if last is None:
            raise EngineError("engine returned no output")
        return Completion(last.request_id, ids[last.index], "".join(texts[last.index]), last.finish_reason,
                          last.num_prompt_tokens, last.num_cached_tokens, last.kv_transfer_params, last.stop_reason)

    async def prefill(
        self,
        prompt_token_ids: Sequence[int],
        request_id: str | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora: str | None = None,
    ) -> PrefillResult:
        """Compute the prompt's KV (the producer connector saves it); one greedy token."""
        out = await self.complete(prompt_token_ids, Sampling(max_tokens=1), request_id, cache_salt,
                                  kv_transfer_params, lora)
        return PrefillResult(
            request_id=out.request_id,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_computed_tokens=out.num_prompt_tokens - out.num_cached_tokens,
            kv_transfer_params=out.kv_transfer_params,
        )

    async def check_health(self, timeout_s: float = 10.0) -> None:
        """Raise :class:`EngineError` unless the engine core answers within ``timeout_s``."""
        self._check_alive()
        try:
            await asyncio.wait_for(self._llm.check_health(), timeout=timeout_s)
        except TimeoutError as e:
            raise EngineError(f"engine health check timed out after {timeout_s}s") from e
        except Exception as e:  # noqa: BLE001
            raise EngineError(f"engine unhealthy: {e}") from e

    def shutdown(self) -> None:
        """Stop the engine-core process and reap it; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        llm = getattr(self, "_llm", None)
        if llm is not None:
            cores = _core_processes(llm)
            with contextlib.suppress(Exception):
                llm.shutdown()  # SIGTERM, a 5 s grace, then SIGKILL of the core's tree
            for proc in cores:  # vLLM does not wait for the cores it kills
                proc.join(_REAP_TIMEOUT_S)
                if proc.is_alive():
                    proc.kill()
                    proc.join(_REAP_TIMEOUT_S)
            # Drop the reference now: AsyncLLM.__del__ at interpreter exit is noisy.
            self._llm = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
