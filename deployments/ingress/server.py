"""Router: the HTTP ingress (OpenAI-compatible routes, agent runs, readiness, metrics).

It validates and tokenizes. A completion (one decoder) then runs its path here, through the
request-path library (deployments/path/fanout.py: the shared prefill or the private fallback, then the
decoder's stream straight to this replica); an agent run goes to the Orchestrator as a typed
job and streams back through it, merged over its decoders. Every bad request gets a 4xx JSON
error in OpenAI's shape whose `param` names the field, and never reaches an engine. In front of
that: the API key (401; its tenant salts the request's KV, app/auth.py), the body size (413),
and admission (429 + Retry-After when this replica already runs `limits.max_inflight_requests`,
or when Serve sheds load downstream).
Request bodies: deployments/ingress/schemas.py; sampling options and the fields the server refuses:
deployments/ingress/request_options.py; tools and content parts: deployments/ingress/tools.py; response
shapes: deployments/ingress/openai_format.py; error statuses: deployments/errors.py.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefillshare.app.auth import KeyRing, Tenant, load_keyring
from prefillshare.app.config import AuthConfig
from prefillshare.app.plan import AppPlan
from prefillshare.app.rendering import SwitchIgnored
from prefillshare.app.sampling import Sampling
from prefillshare.deployments.errors import ApiError, ErrorCode, Failure, error_body
from prefillshare.deployments.fleet import ReplicaBounds, serve_fleet
from prefillshare.deployments.ingress.admission import Outcome, Slot, admission_for, arrived_at
from prefillshare.deployments.ingress.openai_format import Answer, ToolCallOut
from prefillshare.deployments.ingress.prompt_options import (
    cache_salt,
    chat_echo,
    chat_switches,
    chat_turns,
    prompt_logprobs_of,
    truncated,
)
from prefillshare.deployments.ingress.request_options import check_unsupported, load_grammar_backend, sampling_from
from prefillshare.deployments.ingress.schemas import AgentRunBody, Body, ChatBody, CompletionBody, parse, read_body
from prefillshare.deployments.ingress.tools import ToolPlan, plan_tools, read_tool_output
from prefillshare.deployments.ingress.vllm_endpoints import (
    DetokenizeBody,
    TokenizeChatBody,
    tokenize_answer,
    tokenize_body,
    version,
)
from prefillshare.deployments.messages import AgentRunRequest, AgentSpec, CompletionJob, DecodeChunk
from prefillshare.deployments.metrics import MetricsSender
from prefillshare.deployments.path.decode_call import DecoderCall, Output
from prefillshare.deployments.path.fanout import FanOut, Leg
from prefillshare.deployments.path.serve_engines import ServeEngines
from prefillshare.deployments.prompts import Prompter, RenderError


class _ReplicaGone(Exception):
    """The replica a call went to died before it sent anything back."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class _StreamFailed(Exception):
    """A failure reported inside an already-open stream (sent in-band, then [DONE])."""

    def __init__(self, failure: Failure):
        super().__init__(str(failure))
        self.failure = failure


async def _chain(head, rest):
    """The first item (already awaited by the handler) followed by the rest of the stream."""
    yield head
    async for item in rest:
        yield item


class _Completion:
    """A completion's chunks: its prefill (deployments/path/fanout.py, run here: no other deployment
    in between), then its decoder's stream straight to this replica. Iterates like a Serve
    stream; ``cancel()`` stops the decoder's request; ``output`` accumulates the chunks."""

    def __init__(self, fanout: FanOut, job: CompletionJob):
        self._fanout, self._job = fanout, job
        self._call: DecoderCall | None = None
        self.output = Output()
        self._chunks = self._run()

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._chunks.__anext__()

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()

    async def _run(self) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()  # latencies count from here, the prefill included
        job = self._job
        leg = Leg(job.request_id, job.model, job.prompt_token_ids, job.sampling)
        [plan] = await self._fanout.prepare([leg], job.request_id, job.route, job.cache_salt)
        self._call = self._fanout.decode(plan, t0, self.output)
        async for chunk in self._call.chunks():
            yield chunk


def _max_tokens(sampling: Sampling) -> int:
    """The Router's sampling always has ``max_tokens`` (``Router._sampling`` fills the default)."""
    assert sampling.max_tokens is not None, "Router._sampling fills max_tokens"
    return sampling.max_tokens


def _overloaded(message: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, None, "overloaded", "rate_limit_error", {"Retry-After": str(retry_after_s)})


# --- the ingress -----------------------------------------------------------------------
api = FastAPI(title="PrefillShare")


@api.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError):
    return exc.response()


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """Unknown routes and wrong methods in OpenAI's error shape too."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(status_code=exc.status_code,
                        content=error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                           "invalid_request_error", None, code))


@api.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception):
    return JSONResponse(status_code=500, content=error_body(f"internal error: {type(exc).__name__}: {exc}",
                                                            "server_error", None, "internal"))


@serve.deployment(name="Router")
@serve.ingress(api)
class Router:
    def __init__(self, plan: AppPlan, orchestrator, prefill: dict, decoders: dict, metrics,
                 auth: AuthConfig | None = None, bounds: dict[str, ReplicaBounds] | None = None):
        self.plan = plan
        self.orch = orchestrator
        self.prefill = prefill
        self.decoders = decoders
        self.metrics = metrics  # the Metrics deployment: events go through self.events, /metrics renders there
        self.events = MetricsSender(metrics)
        # the engine deployments' replicas as the controller sees them (admission's hold, cold decoders)
        self.fleet = serve_fleet(bounds or {}, self.events)
        self.fleet.start()
        self.fanout = FanOut(plan, ServeEngines(prefill, decoders, self.events, self.fleet))  # completions' own path
        self.prompter = Prompter(plan.tokenizer, plan.renderers)  # each decoder's own rendering
        load_grammar_backend()  # now, not in the first structured request
        self.created = int(time.time())
        self.limits = plan.limits
        self.admission = admission_for(self.limits)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._published_limit = self.admission.limit
        self.events.gauge("admission", self.replica, self._published_limit)
        auth = auth or AuthConfig()
        self.keys: KeyRing | None = load_keyring(auth.keys_file, auth.keys_env, auth.required)

    # --- the edge: key, size, admission ---
    async def _accept(self, request: Request, schema: type[Body]) -> tuple[Body, Tenant | None, float]:
        """Bound, authenticate and parse a generation request (431 / 401 / 413 / 400); also when it
        arrived, for admission's clock (``limits.request_start_header``)."""
        header = self.limits.request_start_header
        arrived = arrived_at(request.headers.get(header) if header else None, self.limits.request_timeout_s)
        header_bytes = sum(len(k) + len(v) for k, v in request.scope.get("headers", ()))
        if header_bytes > self.limits.max_header_bytes:
            raise ApiError(431, f"request headers have {header_bytes} bytes; the limit is "
                           f"{self.limits.max_header_bytes}", None, "headers_too_large")
        tenant = None
        if self.keys is not None:
            tenant = self.keys.lookup(request.headers.get("authorization"))
            if tenant is None:
                raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", None,
                               "invalid_api_key")
        raw = await read_body(request, self.limits.max_body_bytes)
        return parse(raw, schema), tenant, arrived

    def _restarting(self, models) -> None:
        """A request for a decoder with no replica running (it restarts) is shed at once, before
        admission: 503 + Retry-After, and no slot held through the restart."""
        down = sorted({m for m in models if self.fanout.engines.decoder_down(m)})
        if down:
            self.events.send("overloaded", "decoder_restarting")
            raise ApiError(503, f"decoder {', '.join(down)}: no replica is running (it is restarting); retry later",
                           None, "decoder_unavailable", "server_error", {"Retry-After": str(self.limits.retry_after_s)})

    def _admit(self, route: str, arrived: float) -> Slot:
        self.fleet.start()
        self.admission.hold(bool(self.fleet.short()))
        entered = self.admission.try_enter()
        self._publish_limit()
        if not entered:
            self.events.send("overloaded", "ingress")
            raise _overloaded(f"server busy: {self.admission.limit} requests in flight on this replica; retry later",
                              self.limits.retry_after_s)
        return Slot(self.admission, route, arrived)

    def _release(self, slot: Slot, outcome: Outcome) -> None:
        slot.release(outcome)
        self._publish_limit()

    def _publish_limit(self) -> None:
        """A changed admission bound (a latency target steers it, at an answer or an arrival) is
        published as ``prefillshare_admission_limit`` of this replica."""
        if self.admission.limit != self._published_limit:
            self._published_limit = self.admission.limit
            self.events.gauge("admission", self.replica, self._published_limit)

    def _unavailable(self, e: Exception) -> ApiError:
        return ApiError(503, f"service unavailable: {type(e).__name__}: {e}", None, "unavailable", "server_error",
                        {"Retry-After": str(self.limits.retry_after_s)})

    async def _first(self, gen):
        """A stream's first item, awaited before any status is sent: Serve's own rejections
        downstream become OpenAI-shaped 429 / 503 answers; a replica that died before its first
        item is :class:`_ReplicaGone` (the caller may repeat the call: nothing was sent)."""
        try:
            return await gen.__anext__()
        except RayActorError as e:  # ActorDiedError, ActorUnavailableError: the deployment's replica is gone
            raise _ReplicaGone(e) from None
        except BackPressureError as e:
            self.events.send("overloaded", "serve_queue")
            raise _overloaded(f"server busy: {e.message}", self.limits.retry_after_s) from None
        except DeploymentUnavailableError as e:
            raise ApiError(503, f"service unavailable: {e}", None, "unavailable", "server_error",
                           {"Retry-After": str(self.limits.retry_after_s)}) from None

    def _failure(self, failure: Failure, route: str) -> ApiError:
        if failure.code is ErrorCode.OVERLOADED:
            self.events.send("overloaded", "engine_queue")
        return ApiError.from_failure(failure, route, self.limits.retry_after_s)

    async def _serve(self, route: str, arrived: float, start: Callable[[], Any], stream: bool,
                     events: Callable[[Any, Any], AsyncIterator[str]],
                     collect: Callable[[Any, Any], Awaitable[Any]], repeatable: bool = False):
        """Admit -> first item -> stream or collect -> release, for every generation route.

        The first item is awaited before any status is sent, so a request shed downstream or
        failed before any output still gets its own status (a stream's status is fixed once it
        starts). The admission slot is held until the answer (or its stream) ends, however it ends.
        ``start`` makes the call once admitted; a ``repeatable`` call (to another deployment) whose
        replica died before its first item is made once more (a completion's own path retries
        below, in DecoderCall).
        """
        slot = self._admit(route, arrived)
        deadline = asyncio.get_running_loop().time() + self.limits.request_timeout_s
        call = start()
        streaming = repeated = False
        outcome: Outcome = "failed"
        try:
            async with asyncio.timeout_at(deadline):
                try:
                    head = await self._first(call)
                except _ReplicaGone as gone:  # e.g. the Orchestrator died: nothing reached the client
                    if not repeatable:
                        raise self._unavailable(gone.cause) from None
                    self.events.send("fallback", "router_retry", 1)
                    call, repeated = start(), True
                    try:
                        head = await self._first(call)
                    except _ReplicaGone as gone_again:
                        raise self._unavailable(gone_again.cause) from None
            if isinstance(head, DecodeChunk) and head.error:
                raise self._failure(head.error, route)
            if stream:
                streaming = True
                return StreamingResponse(self._sse(events(head, call), call, slot, route, deadline),
                                         media_type="text/event-stream")
            try:
                async with asyncio.timeout_at(deadline):
                    result = await collect(head, call)
            except RayActorError as e:  # the replica died mid-answer; the client has received nothing yet
                if not repeatable or repeated:
                    raise self._unavailable(e) from None
                self.events.send("fallback", "router_retry", 1)  # so the whole call is made once more
                async with asyncio.timeout_at(deadline):
                    call = start()
                    try:
                        result = await collect(await self._first(call), call)
                    except (_ReplicaGone, RayActorError) as again:
                        raise self._unavailable(getattr(again, "cause", again)) from None
            outcome = "completed"
            return result
        except TimeoutError:
            call.cancel()
            slot.late()
            raise self._failure(self._timed_out(route), route) from None
        except ApiError as e:
            if e.status == 429:  # shed downstream (a Serve or engine queue was full): the app is past its load
                slot.late()
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if not streaming:
                self._release(slot, outcome)

    def _timed_out(self, route: str) -> Failure:
        self.events.send("timeout", route)
        return Failure(ErrorCode.TIMEOUT, f"the request did not finish within limits.request_timeout_s "
                       f"({self.limits.request_timeout_s:g} s)")

    async def _sse(self, events: AsyncIterator[str], call, slot: Slot, route: str, deadline: float):
        """Server-sent events of one answer; failures in-band in OpenAI's error shape, then [DONE].
        The request's deadline bounds each wait for the next event, never a yield (the client's pace)."""
        finished = False
        outcome: Outcome = "cancelled"  # unless the stream ends: the client went away
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        event = await anext(events)
                except StopAsyncIteration:
                    break
                yield event
            finished = True
            outcome = "completed"
        except TimeoutError:
            outcome = "failed"
            slot.late()
            yield "data: " + json.dumps(self._failure(self._timed_out(route), route).body()) + "\n\n"
        except _StreamFailed as e:
            outcome = "failed"
            yield "data: " + json.dumps(self._failure(e.failure, route).body()) + "\n\n"
        except RayActorError as e:  # the replica relaying this stream (the Orchestrator) died
            outcome = "failed"
            yield "data: " + json.dumps(self._unavailable(e).body()) + "\n\n"
        except Exception as e:  # noqa: BLE001 - the stream is already open; report in-band
            outcome = "failed"
            yield "data: " + json.dumps(error_body(f"internal error: {e}", "server_error", None, "internal")) + "\n\n"
        finally:  # also on a client disconnect (the generator is cancelled): free the slot, stop the engines
            self._release(slot, outcome)
            if not finished:
                call.cancel()
        yield "data: [DONE]\n\n"

    # --- validation helpers ---
    def _decoder(self, model: str, param: str = "model"):
        if not self.plan.serves(model):
            known = ", ".join(d.name for d in self.plan.decoders)
            raise ApiError(404, f"{param}: model {model!r} does not exist; served models: {known}", param,
                           "model_not_found")
        return self.plan.decoder(model)

    def _sampling(self, body, **kw) -> Sampling:
        """The request's sampling with ``max_tokens`` filled (``limits.max_tokens_default``)."""
        return sampling_from(body, self.limits, self.prompter.eos_token_id, self.prompter.vocab_size,
                             encode=lambda text: self.prompter.encode(text, add_special_tokens=False), **kw)

    def _check_length(self, ids: list[int], sampling: Sampling, limit: int, param: str,
                      mt_param: str = "max_tokens") -> None:
        max_tokens = _max_tokens(sampling)
        if not ids:
            raise ApiError.invalid(param, f"{param} is empty")
        if len(ids) >= limit:
            raise ApiError(400, f"{param} has {len(ids)} tokens; this model's context is {limit} tokens",
                           param, "context_length_exceeded")
        if len(ids) + max_tokens > limit:
            raise ApiError(400, f"{param} ({len(ids)} tokens) + {mt_param} ({max_tokens}) exceeds "
                           f"the context of {limit} tokens", mt_param, "context_length_exceeded")

    def _salt(self, tenant: Tenant | None) -> str | None:
        return tenant.salt if tenant else None

    def _answer_options(self, body, ids: list[int]) -> dict:
        """vLLM's answer switches (return_token_ids, return_tokens_as_token_ids) for Answer."""
        return {"token_ids": bool(body.return_token_ids), "tokens_as_ids": bool(body.return_tokens_as_token_ids),
                "first_token": self.prompter.tok.decode(ids[:1])}

    # --- routes ---
    @api.get("/healthz")
    async def healthz(self):
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self):
        data = []
        for d in self.plan.decoders:
            # "parent" as vLLM's server sets it for a LoRA adapter: the model (here the decode
            # group) that serves it; None for a full-weight decoder
            data.append({"id": d.name, "object": "model", "created": self.created, "owned_by": "prefillshare",
                         "parent": (d.group or d.prefill_module) if d.adapter else None, "max_model_len": d.max_model_len,
                         "prefill_module": d.prefill_module, "private_prefill_reason": d.private_detail})
        return {"object": "list", "data": data}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        body, tenant, arrived = await self._accept(request, CompletionBody)
        check_unsupported(body)
        dp = self._decoder(body.model)
        sampling = self._sampling(body, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs_of(body, body.logprobs))
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError.invalid("prompt", "prompt: batches of prompts are not supported; send one")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ApiError.invalid("prompt", "prompt is empty")
            ids = self.prompter.encode(prompt, body.add_special_tokens is not False)
        else:
            ids = [int(t) for t in prompt]  # token ids (a list of strings was one string, taken above)
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.prompter.vocab_size), None)
            if bad is not None:
                raise ApiError.invalid("prompt", f"prompt[{bad}]: token id {ids[bad]} is outside the vocabulary "
                                       f"[0, {self.prompter.vocab_size})")
        whole = len(ids)
        ids = truncated(ids, body, dp.max_model_len, _max_tokens(sampling))
        self._check_length(ids, sampling, dp.max_model_len, "prompt")
        job = CompletionJob(f"cmpl-{uuid.uuid4().hex}", body.model, tuple(ids), sampling, "completions",
                            cache_salt=cache_salt(self._salt(tenant), body.cache_salt))
        echo = None
        if body.echo:
            echo = prompt if isinstance(prompt, str) and len(ids) == whole else self.prompter.decode(ids)
        return await self._completion(job, body, None, arrived, chat=False, echo=echo,
                                      logprobs=body.logprobs is not None, **self._answer_options(body, ids))

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        body, tenant, arrived = await self._accept(request, ChatBody)
        check_unsupported(body)
        dp = self._decoder(body.model)
        mt_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError.invalid("top_logprobs", "top_logprobs: set logprobs to true to use it")
        tools = plan_tools(body, dp.tool_call_format, body.model)
        if tools is not None and body.response_format is not None and body.response_format.type != "text":
            raise ApiError.invalid("response_format", "response_format: cannot be combined with tools (the tool "
                                   "call is the structured output)")
        sampling = self._sampling(
            body, max_tokens=body.max_completion_tokens, max_tokens_param=mt_param,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None, logprobs_param="top_logprobs",
            constraint=tools.constraint if tools is not None else None,
            prompt_logprobs=prompt_logprobs_of(body, body.top_logprobs or 0))
        ids, conversation = self._chat_ids(body, dp, tools)
        ids = truncated(ids, body, dp.max_model_len, _max_tokens(sampling))
        self._check_length(ids, sampling, dp.max_model_len, "messages", mt_param)
        job = CompletionJob(f"chatcmpl-{uuid.uuid4().hex}", body.model, tuple(ids), sampling, "chat",
                            cache_salt=cache_salt(self._salt(tenant), body.cache_salt))
        return await self._completion(job, body, tools, arrived, chat=True, echo=chat_echo(body, conversation),
                                      logprobs=bool(body.logprobs), **self._answer_options(body, ids))

    def _chat_ids(self, body, dp, tools: ToolPlan | None) -> tuple[list[int], list[tuple[str, str]]]:
        """A chat body's prompt ids in its decoder's rendering (the chat route and /tokenize)."""
        conversation = chat_turns(body)
        line = tools.prompt_line if tools is not None else None
        try:
            return (self.prompter.chat_prompt(conversation, model=dp.name, tools_line=line, **chat_switches(body)),
                    conversation)
        except SwitchIgnored as e:
            raise ApiError.invalid(e.field, str(e)) from None
        except RenderError as e:
            raise ApiError.invalid("messages", f"messages: {e}") from None

    async def _completion(self, job: CompletionJob, body, tools: ToolPlan | None, arrived: float, chat: bool,
                          echo: str | None = None, logprobs: bool = False, **options):
        self._restarting([job.model])
        call = _Completion(self.fanout, job)
        answer = Answer(job, chat, call.output, echo, logprobs, **options)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events(head, call) -> AsyncIterator[str]:
            started: set[int] = set()
            async for chunk in _chain(head, call):
                if chunk.error:
                    raise _StreamFailed(chunk.error)
                seq = answer.output.seq(chunk.index)
                if tools is None:
                    yield answer.delta_event(chunk, first=chunk.index not in started)
                    started.add(chunk.index)
                elif chunk.finish_reason is not None:  # a tool call is read back whole
                    calls, text = read_tool_output(seq.text)
                    if calls is not None:
                        finish = "tool_calls" if chunk.finish_reason == "stop" else chunk.finish_reason
                        yield answer.tool_call_event(chunk.index, calls, finish)
                    else:
                        yield answer.delta_event(DecodeChunk(job.request_id, job.model, text, [], chunk.finished,
                                                             chunk.finish_reason, index=chunk.index), first=True)
            if include_usage:
                yield answer.usage_event()

        async def collect(head, call) -> dict:
            async for chunk in _chain(head, call):
                if chunk.error:
                    raise self._failure(chunk.error, job.route)
            calls: dict[int, list[ToolCallOut]] = {}
            if tools is not None:
                for i, seq in answer.output.seqs.items():
                    found, seq.text = read_tool_output(seq.text)
                    if found is not None:
                        calls[i] = found
            return answer.response(job.sampling.n, calls)

        return await self._serve(job.route, arrived, lambda: call, body.stream, events, collect)

    @api.post("/v1/agents/run")
    async def agents_run(self, request: Request):
        body, tenant, arrived = await self._accept(request, AgentRunBody)
        req = self._agent_run(body, tenant)

        async def events(head, call) -> AsyncIterator[str]:
            async for ev in _chain(head, call):
                out: dict[str, Any] = {"id": req.request_id, "type": ev.kind, "round": ev.round}
                if ev.kind == "delta":
                    out.update(agent=ev.agent, model=ev.model, text=ev.delta_text)
                elif ev.kind == "agent_done":
                    out.update(agent=ev.agent, model=ev.model, result=ev.result)
                else:
                    out.update(ev.result)
                yield "data: " + json.dumps(out) + "\n\n"

        async def collect(head, call) -> dict:
            final = head.result if head.kind == "done" else None
            async for ev in call:
                if ev.kind == "done":
                    final = ev.result
            if final is None:
                raise ApiError(500, "the agent run ended without a result", None, "internal", "server_error")
            return {"id": req.request_id, "object": "agents.run", "created": int(time.time()), **final}

        self._restarting(a.model for r in req.rounds for a in r)
        return await self._serve("agents", arrived, lambda: self.orch.options(stream=True).run.remote(req), body.stream,
                                 events, collect, repeatable=True)

    def _agent_run(self, body: AgentRunBody, tenant: Tenant | None) -> AgentRunRequest:
        """Validate an agent run; the first round's prompts are tokenized here, once."""
        if not body.context.strip():
            raise ApiError.invalid("context", "context is empty")
        if isinstance(body.rounds, list):
            if body.agents is not None:
                raise ApiError.invalid("agents", "give either agents (with rounds as a count) or rounds as a list "
                                       "of agent lists")
            raw_rounds, prefix = body.rounds, "rounds"
        else:
            if not body.agents:
                raise ApiError.invalid("agents", "agents: give at least one agent")
            n = 1 if body.rounds is None else body.rounds
            if not 1 <= n <= self.limits.max_rounds:
                raise ApiError.invalid("rounds", f"rounds must be in [1, {self.limits.max_rounds}]")
            raw_rounds, prefix = [body.agents] * n, None
        if len(raw_rounds) > self.limits.max_rounds:
            raise ApiError.invalid("rounds", f"rounds: at most {self.limits.max_rounds}")
        rounds = []
        for r, agents in enumerate(raw_rounds):
            if not agents:
                raise ApiError.invalid(f"rounds[{r}]", f"rounds[{r}]: give at least one agent")
            if len(agents) > self.limits.max_agents:
                raise ApiError.invalid("agents", f"at most {self.limits.max_agents} agents per round")
            specs, names = [], set()
            for i, a in enumerate(agents):
                p = f"rounds[{r}][{i}]." if prefix else f"agents[{i}]."
                dp = self._decoder(a.model, p + "model")
                if not a.instruction.strip():
                    raise ApiError.invalid(p + "instruction", f"{p}instruction is empty")
                name = a.name or a.model
                if name in names:
                    raise ApiError.invalid(p + "name", f"{p}name: {name!r} appears twice in one round; give agents "
                                           "distinct names")
                names.add(name)
                sampling = self._sampling(a, prefix=p, logprobs=a.logprobs)
                ids: tuple[int, ...] = ()
                if r == 0:
                    ids = tuple(self.prompter.agent_prompt(body.context, a.instruction, model=a.model))
                    self._check_length(list(ids), sampling, dp.max_model_len, "context", p + "max_tokens")
                specs.append(AgentSpec(name, a.model, a.instruction, sampling, ids))
            rounds.append(tuple(specs))
        return AgentRunRequest(f"run-{uuid.uuid4().hex}", body.context, tuple(rounds), body.join_outputs,
                               cache_salt=cache_salt(self._salt(tenant), body.cache_salt))

    # --- vLLM's extra endpoints (deployments/ingress/vllm_endpoints.py) ---
    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        body = tokenize_body(await read_body(request, self.limits.max_body_bytes))
        dp = self._decoder(body.model or self.plan.decoders[0].name)
        if isinstance(body, TokenizeChatBody):
            check_unsupported(body)
            ids, _ = self._chat_ids(body, dp, plan_tools(body, dp.tool_call_format, dp.name))
        else:
            ids = self.prompter.encode(body.prompt, body.add_special_tokens)
        return tokenize_answer(self.prompter.tok, ids, dp.max_model_len, body.return_token_strs)

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        body = parse(await read_body(request, self.limits.max_body_bytes), DetokenizeBody)
        self._decoder(body.model or self.plan.decoders[0].name)
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < self.prompter.vocab_size), None)
        if bad is not None:
            raise ApiError.invalid("tokens", f"tokens[{bad}]: token id {body.tokens[bad]} is outside the vocabulary "
                                   f"[0, {self.prompter.vocab_size})")
        return {"prompt": self.prompter.tok.decode(body.tokens)}

    @api.get("/version")
    async def version(self):
        return version()

    @api.get("/health")
    async def health(self):
        """vLLM's liveness answer: 200 with an empty body while every deployment is healthy."""
        app_status = serve.status().applications.get(serve.get_replica_context().app_name)
        healthy = app_status is None or all(str(d.status).split(".")[-1] == "HEALTHY"
                                            for d in app_status.deployments.values())
        return Response(status_code=200 if healthy else 503)

    @api.get("/ready")
    async def ready(self):
        """200 when every engine deployment is healthy and answers a probe; 503 otherwise. A decoder its
        autoscaler stopped (``min_replicas: 0``) is not probed (a probe would start it): it is listed
        under ``asleep`` and starts on its next request."""
        problems: list[str] = []
        try:
            app_status = serve.status().applications.get(serve.get_replica_context().app_name)
            if app_status is not None:
                for name, d in app_status.deployments.items():
                    if str(d.status).split(".")[-1] != "HEALTHY":
                        problems.append(f"{name}: {d.status}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"serve status: {e}")
        probes = {f"prefill:{k}": h for k, h in self.prefill.items()}
        asleep = sorted(k for k in self.decoders if self.fanout.engines.decoder_cold(k))
        probes.update({f"decoder:{k}": h for k, h in self.decoders.items() if k not in asleep})
        probes["orchestrator"] = self.orch

        async def probe(name, h):
            try:
                await asyncio.wait_for(h.ready.remote(), timeout=15)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{name}: {type(e).__name__}: {e}")

        await asyncio.gather(*[probe(k, h) for k, h in probes.items()])
        if problems:
            return JSONResponse(status_code=503, content={"ready": False, "problems": sorted(problems),
                                                          "admission": self.admission.snapshot()})
        return {"ready": True, "engines": len(self.prefill) + len(self.decoders), "asleep": asleep,
                "admission": self.admission.snapshot()}

    @api.get("/sharing")
    async def sharing(self):
        """The deploy-time sharing check (app/sharing.py): per prefill module, what a fan-out of one
        probe request to its decoders costs the base, and each decoder that shares nothing, why."""
        reports = [r.to_dict() for r in self.plan.sharing]
        return {"sharing": all(d["shares"] for r in reports for d in r["decoders"]), "modules": reports}

    @api.get("/metrics")
    async def metrics_text(self):
        body = await self.metrics.render.remote()
        return Response(content=body, media_type="text/plain; version=0.0.4; charset=utf-8")
