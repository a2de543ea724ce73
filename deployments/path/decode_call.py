"""One decoder request as its caller runs it, and the output it accumulates.

Two callers stream decoders: the Router for a completion (straight from the decoder, one Ray
stream per token) and the Orchestrator for each agent of a run (it merges the agents'
streams). Both run a :class:`DecodePlan` (made by deployments/path/fanout.py) through
:class:`DecoderCall`, the one place that turns a failed or shed call into a typed error chunk,
stamps the prefill fields on the chunks, accumulates the deltas into an :class:`Output`
(what both callers build their answers from), counts a ``kv_miss`` fallback and sends the
request's metrics record.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from prefillshare.app.prompt_split import shared_length
from prefillshare.app.sampling import TokenLogprob
from prefillshare.deployments.errors import ErrorCode, Failure, Shed, Unreachable
from prefillshare.deployments.messages import DecodeChunk, DecodeRequest, PrefillTicket, RequestRecord
from prefillshare.deployments.path.engines import DecodeStream, Engines


@dataclass(frozen=True)
class DecodePlan:
    """A decoder request made ready (routing, shared prefill or the private fallback done), and
    what its caller needs besides: the prefill that computed its KV (None: private prefill) for
    the chunks' fields and the metrics record. ``error`` is set, and nothing is to be decoded,
    when the request failed before its decoder (a prefill module that sheds load)."""

    request: DecodeRequest
    model: str  # the served decoder name
    agent: str  # "" for an OpenAI completion
    route: str  # "completions" | "chat" | "agents"
    ticket: PrefillTicket | None = None
    kv_bytes_per_token: int = 0
    error: Failure | None = None

    @property
    def shared_tokens_expected(self) -> int:
        """Prompt tokens whose KV the prefill module published (the hand-over convention)."""
        return shared_length(len(self.request.prompt_token_ids)) if self.ticket is not None else 0


@dataclass
class Sequence:
    """One of a request's ``n`` generated sequences, accumulated from its deltas."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_chars: int = 0  # len(text), without joining the parts
    _parts: list[str] = field(default_factory=list, repr=False)  # the text's deltas, joined when read

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @text.setter
    def text(self, value: str) -> None:
        self._parts[:], self.num_chars = [value], len(value)

    def add(self, chunk: DecodeChunk) -> None:
        if chunk.delta_text:
            self._parts.append(chunk.delta_text)
            self.num_chars += len(chunk.delta_text)
        self.token_ids.extend(chunk.delta_token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason


@dataclass
class Output:
    """A decoder request's output so far: its sequences by index, the prompt tokens it did not
    compute, its first-token latency and its failure."""

    seqs: dict[int, Sequence] = field(default_factory=dict)
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    error: Failure | None = None
    prefill_module: str | None = None  # who computed the shared KV (None: private prefill)
    prefill_replica: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the decoder's, when the sampling asked

    def seq(self, index: int = 0) -> Sequence:
        return self.seqs.get(index) or Sequence()

    @property
    def num_generated(self) -> int:
        return sum(len(q.token_ids) for q in self.seqs.values())

    def add(self, chunk: DecodeChunk) -> Sequence:
        q = self.seqs.setdefault(chunk.index, Sequence())
        q.add(chunk)
        self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        return q


class _EngineFailed(Exception):
    """A replica's engine failed the request before any output (its engine core died): retried."""

    def __init__(self, failure: Failure):
        super().__init__(str(failure))
        self.failure = failure


class DecoderCall:
    """Streams ``plan.request`` to decoder ``plan.model`` through ``engines``.

    ``chunks()`` always ends with a finished chunk (an error chunk when the call failed:
    ``overloaded`` when Serve shed it, ``decoder_unavailable`` when the replica died or could not
    be reached); every chunk is in ``output`` by the time the caller sees it. A call whose replica
    died, or whose engine failed it, before any output reached the caller is repeated once
    (``decoder_retry``): Serve routes the repeat to a surviving replica, or to the restarted one. Latencies count
    from ``t0``, when the request reached its first deployment (prefill included). ``cancel()``
    stops the decoder's request (a client that went away). ``wait_s`` bounds the wait for a
    replica while the decoder has none (``limits.decoder_wait_s``): a restarting decoder's calls
    fail fast instead of holding the caller's admission slots. The one retry of a call whose
    replica died under it is admitted work: it waits for the restart, until ``deadline``
    (``perf_counter`` time: the request's timeout, ``limits.request_timeout_s`` from ``t0``).
    """

    def __init__(self, engines: Engines, plan: DecodePlan, t0: float, output: Output | None = None,
                 wait_s: float | None = None, deadline: float | None = None):
        self.engines, self.plan, self.t0, self.wait_s, self.deadline = engines, plan, t0, wait_s, deadline
        self.output = output if output is not None else Output()
        self.output.error = plan.error
        if plan.ticket is not None:
            self.output.prefill_module, self.output.prefill_replica = plan.ticket.prefill_module, plan.ticket.replica_id
        self._stream: DecodeStream | None = None
        self._recorded = False

    def cancel(self) -> None:
        if self._stream is not None:
            self._stream.cancel()

    def _failed(self, failure: Failure, record: bool = True) -> DecodeChunk:
        """The call's last chunk, a failure, recorded first (unless it never reached a decoder): a
        caller stops reading at a failure, so nothing after its yield would run."""
        self.output.error = failure
        if record:
            self._record()
        return DecodeChunk(self.plan.request.request_id, self.plan.model, "", [], True, "error", error=failure)

    async def chunks(self) -> AsyncIterator[DecodeChunk]:
        plan, out = self.plan, self.output
        if plan.error is not None:  # failed before any decoder (shed, no replica): nothing to record
            yield self._failed(plan.error, record=False)
            return
        module, replica = out.prefill_module, out.prefill_replica
        request, retried = plan.request, False
        while True:
            sent = False  # a chunk reached the caller: the request can no longer be repeated
            try:
                self._stream = stream = self.engines.decode(plan.model, request,
                                                            self._retry_wait() if retried else self.wait_s)
                async for chunk in stream:
                    if chunk.error and not sent and chunk.error.code is ErrorCode.ENGINE_ERROR:
                        raise _EngineFailed(chunk.error)  # its engine died before any output: retried below
                    if chunk.error:
                        out.error = chunk.error
                        self._record()  # the caller stops reading at a failure
                    else:
                        if out.ttft_s is None and chunk.delta_token_ids:
                            out.ttft_s = time.perf_counter() - self.t0
                        out.add(chunk)
                    if module is None and chunk.prefill_module is not None:  # an in-engine decoder's module
                        module, replica = chunk.prefill_module, chunk.prefill_replica
                        out.prefill_module, out.prefill_replica = module, replica
                    chunk.prefill_module, chunk.prefill_replica = module, replica
                    sent = True
                    yield chunk
            except Shed as e:
                yield self._failed(Failure(ErrorCode.OVERLOADED, f"decoder {plan.model}: {e}"))
            except Unreachable as e:  # no replica running: not retried (it would wait the same)
                yield self._failed(Failure(ErrorCode.DECODER_UNAVAILABLE, str(e)))
            except Exception as e:  # noqa: BLE001 - a dead replica or engine fails this request only
                if not sent and not retried:
                    # Nothing of it reached the caller: repeat it once, on a surviving replica or the
                    # restarted one; its connector loads the shared KV if the pool still holds it,
                    # else it prefills privately (counted as kv_miss).
                    retried = True
                    self.engines.fallback("decoder_retry")
                    request = replace(request, request_id=f"{request.request_id}-retry")
                    continue
                yield self._failed(e.failure if isinstance(e, _EngineFailed) else Failure(
                    ErrorCode.DECODER_UNAVAILABLE, f"decoder {plan.model}: {type(e).__name__}: {e}"))
            break
        self._record()

    def _retry_wait(self) -> float | None:
        """What is left of the request's time for the retry's wait for a replica (None: no deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())

    def _record(self) -> None:
        """The call's metrics record, once."""
        if self._recorded:
            return
        self._recorded = True
        plan, req, out = self.plan, self.plan.request, self.output
        if plan.shared_tokens_expected and out.error is None and out.num_cached_tokens == 0:
            self.engines.fallback("kv_miss")
        self.engines.record(RequestRecord(
            model=plan.model, agent=plan.agent, route=plan.route, ttft_s=out.ttft_s,
            e2e_s=time.perf_counter() - self.t0, prompt_tokens=len(req.prompt_token_ids),
            generated_tokens=out.num_generated, shared_tokens_expected=plan.shared_tokens_expected,
            shared_tokens_loaded=out.num_cached_tokens, kv_bytes_per_token=plan.kv_bytes_per_token,
            ok=out.error is None))
