"""One request to a decode deployment, as its caller runs it.

Two callers stream decoders: the Router for a single-decoder completion (straight from the
decoder, one Ray stream per token) and the Orchestrator for each agent of a run (it merges the
agents' streams). Both go through :class:`DecoderCall`, the one place that turns a failed or
shed call into a typed error chunk, stamps the prefill fields on the chunks, counts a
``kv_miss`` fallback and sends the request's metrics record.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray.serve.exceptions import BackPressureError

from deployments.errors import ErrorCode, Failure
from deployments.messages import DecodeChunk, DecodePlan
from deployments.metrics import RequestRecord


class DecoderCall:
    """Streams ``plan.request`` on ``handle`` (a streaming handle of the decode deployment).

    ``chunks()`` always ends with a finished chunk (an error chunk when the call failed:
    ``overloaded`` when Serve shed it, ``decoder_unavailable`` when the replica died or could not
    be reached). Latencies count from ``t0``, when the request reached its first deployment
    (prefill included). ``cancel()`` stops the decoder's request (a client that went away).
    """

    def __init__(self, handle, plan: DecodePlan, t0: float, metrics=None):
        self.handle, self.plan, self.t0, self.metrics = handle, plan, t0, metrics
        self.error: Failure | None = plan.error
        self.num_cached_tokens = 0
        self.num_generated = 0
        self.ttft_s: float | None = None
        self._response = None

    def cancel(self) -> None:
        if self._response is not None:
            self._response.cancel()

    def _failed(self, failure: Failure) -> DecodeChunk:
        self.error = failure
        return DecodeChunk(self.plan.request.request_id, self.plan.model, "", [], True, "error", error=failure)

    async def chunks(self) -> AsyncIterator[DecodeChunk]:
        plan = self.plan
        if plan.error is not None:
            yield self._failed(plan.error)
            return
        try:
            self._response = self.handle.generate.remote(plan.request)
            async for chunk in self._response:
                if chunk.error:
                    self.error = chunk.error
                else:
                    if self.ttft_s is None and chunk.delta_token_ids:
                        self.ttft_s = time.perf_counter() - self.t0
                    self.num_generated += len(chunk.delta_token_ids)
                    self.num_cached_tokens = chunk.num_cached_tokens
                chunk.prefill_module, chunk.prefill_replica = plan.prefill_module, plan.prefill_replica
                yield chunk
        except BackPressureError as e:
            yield self._failed(Failure(ErrorCode.OVERLOADED, f"decoder {plan.model}: {e}"))
        except Exception as e:  # noqa: BLE001 - a dead replica fails this request only
            yield self._failed(Failure(ErrorCode.DECODER_UNAVAILABLE, f"decoder {plan.model}: {type(e).__name__}: {e}"))
        self._record()

    def _record(self) -> None:
        if self.metrics is None:
            return
        plan, req = self.plan, self.plan.request
        if plan.shared_tokens_expected and self.error is None and self.num_cached_tokens == 0:
            self.metrics.fallback.remote("kv_miss", 1)
        self.metrics.request.remote(RequestRecord(
            model=plan.model, agent=plan.agent, route=plan.route, ttft_s=self.ttft_s,
            e2e_s=time.perf_counter() - self.t0, prompt_tokens=len(req.prompt_token_ids),
            generated_tokens=self.num_generated, shared_tokens_expected=plan.shared_tokens_expected,
            shared_tokens_loaded=self.num_cached_tokens, kv_bytes_per_token=plan.kv_bytes_per_token,
            ok=self.error is None))
