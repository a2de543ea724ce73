"""Router: the HTTP ingress (OpenAI-compatible routes, agent runs, readiness, metrics).

It validates and tokenizes, then hands typed jobs to the Orchestrator; it holds no serving
logic. Every bad request gets a 4xx JSON error in OpenAI's shape whose `param` names the
field, and never reaches an engine. In front of that: the API key (401; its tenant salts the
request's KV, app/auth.py), the body size (413), and admission (429 + Retry-After when this
replica already runs `limits.max_inflight_requests`, or when Serve sheds load downstream).
Unknown fields are rejected on /v1/agents/run (our schema) and ignored on the OpenAI routes,
whose clients send extras such as `user`; OpenAI fields that would change the output but are
not implemented (`stop`, `logprobs`, `echo`, ...) are rejected rather than silently ignored.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.auth import KeyRing, Tenant, load_keyring
from app.config import AuthConfig, LimitsConfig
from deployments.admission import Admission, Outcome, Slot
from deployments.messages import AgentRunRequest, AgentSpec, AppPlan, CompletionJob, SamplingSpec
from deployments.prompts import Prompter

Number = StrictFloat | StrictInt


# --- request schemas (validated at the edge) -------------------------------------------
class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

    max_tokens: StrictInt | None = None
    temperature: Number = 0.0
    top_p: Number = 1.0
    seed: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    # OpenAI fields that change the output; only their "off" values are accepted (checked in _sampling)
    stop: StrictStr | list[StrictStr] | None = None
    logprobs: StrictBool | StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    logit_bias: dict[str, Number] | None = None
    suffix: StrictStr | None = None


class CompletionBody(_Sampling):
    model: StrictStr
    prompt: StrictStr | list[StrictInt] | list[StrictStr]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr


class ChatBody(_Sampling):
    model: StrictStr
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None


class AgentBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr | None = None
    model: StrictStr
    instruction: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number = 0.0
    top_p: Number = 1.0
    seed: StrictInt | None = None


class AgentRunBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context: StrictStr
    agents: list[AgentBody] | None = None
    rounds: StrictInt | list[list[AgentBody]] | None = None
    join_outputs: StrictBool = True
    stream: StrictBool = False


class ApiError(Exception):
    """A client error: HTTP status and OpenAI's error object (plus headers such as Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None, code: str,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.type, self.param, self.code),
                            headers=self.headers)


def error_body(message: str, type_: str, param: str | None, code: str) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "list[int]", "list[str]", "list[list[AgentBody]]") or \
                str(part).startswith(("list[", "function-")):
            continue  # union-member labels pydantic adds to the location
        else:
            out += ("." if out else "") + str(part)
    return out


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, or 413 past ``max_bytes`` (checked on Content-Length first, then on what came)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body has {declared} bytes; the limit is {max_bytes}", None,
                       "request_too_large")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise ApiError(413, f"request body has {len(raw)} bytes; the limit is {max_bytes}", None,
                       "request_too_large")
    return raw


def parse(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """Body -> schema, or ApiError naming the bad field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start})", None, "invalid_encoding") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", None, "invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = _loc(err["loc"])
        raise ApiError(400, f"{field or 'body'}: {err['msg']}", field or None, "invalid_value") from None


def _usage(job: CompletionJob, last) -> dict:
    prompt = len(job.prompt_token_ids)
    completion = last.num_generated_tokens if last is not None else 0
    cached = last.num_cached_tokens if last is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _engine_error(error: str, retry_after_s: int = 1) -> JSONResponse:
    """A failure the orchestrator reported before any output, as an HTTP answer."""
    retry = {"Retry-After": str(retry_after_s)}
    if error.startswith("invalid_request"):
        return JSONResponse(status_code=400, content=error_body(error, "invalid_request_error", "prompt", "invalid_value"))
    if error.startswith("overloaded"):
        return JSONResponse(status_code=429, content=error_body(error, "rate_limit_error", None, "overloaded"),
                            headers=retry)
    return JSONResponse(status_code=503, content=error_body(error, "server_error", None, "engine_error"),
                        headers=retry)


async def _chain(head, rest):
    """The first item (already awaited by the handler) followed by the rest of the stream."""
    yield head
    async for item in rest:
        yield item


def _overloaded(message: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, None, "overloaded", "rate_limit_error", {"Retry-After": str(retry_after_s)})


# OpenAI fields this server does not implement; a request must leave them at their "off" value.
_OFF_VALUES: dict[str, tuple] = {
    "stop": (None, "", []), "logprobs": (None, False, 0), "echo": (False,), "best_of": (None, 1),
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": (None, {}), "suffix": (None, ""),
}


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
                 limits: LimitsConfig | None = None, auth: AuthConfig | None = None):
        self.plan = plan
        self.orch = orchestrator
        self.prefill = prefill
        self.decoders = decoders
        self.metrics = metrics
        self.prompter = Prompter(plan.tokenizer)
        self.created = int(time.time())
        self.limits = limits or LimitsConfig()
        self.admission = Admission(self.limits.max_inflight_requests)
        auth = auth or AuthConfig()
        self.keys: KeyRing | None = load_keyring(auth.keys_file, auth.keys_env, auth.required)

    # --- the edge: key, size, admission ---
    async def _accept(self, request: Request, schema: type[BaseModel]) -> tuple[BaseModel, Tenant | None]:
        """Bound, authenticate and parse a generation request (431 / 401 / 413 / 400)."""
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
        return parse(raw, schema), tenant

    def _admit(self, route: str) -> Slot:
        if not self.admission.try_enter():
            raise _overloaded(f"server busy: {self.admission.limit} requests in flight on this replica; retry later",
                              self.limits.retry_after_s)
        return Slot(self.admission, route)

    async def _first(self, gen):
        """A stream's first item, awaited before any status is sent: Serve's own rejections
        downstream become OpenAI-shaped 429 / 503 answers."""
        try:
            return await gen.__anext__()
        except BackPressureError as e:
            raise _overloaded(f"server busy: {e.message}", self.limits.retry_after_s) from None
        except DeploymentUnavailableError as e:
            raise ApiError(503, f"service unavailable: {e}", None, "unavailable", "server_error",
                           {"Retry-After": str(self.limits.retry_after_s)}) from None

    # --- validation helpers ---
    def _decoder(self, model: str, param: str = "model"):
        dp = self.plan.decoder(model)
        if dp is None:
            known = ", ".join(d.name for d in self.plan.decoders)
            raise ApiError(404, f"{param}: model {model!r} does not exist; served models: {known}", param,
                           "model_not_found")
        return dp

    def _sampling(self, body, max_tokens: int | None, prefix: str = "") -> SamplingSpec:
        p = prefix
        if max_tokens is None:
            max_tokens = self.plan.max_tokens_default
        if max_tokens < 1:
            raise ApiError(400, f"{p}max_tokens must be >= 1, got {max_tokens}", f"{p}max_tokens", "invalid_value")
        if max_tokens > self.plan.max_tokens_cap:
            raise ApiError(400, f"{p}max_tokens must be <= {self.plan.max_tokens_cap}, got {max_tokens}",
                           f"{p}max_tokens", "invalid_value")
        if not 0 <= body.temperature <= 2:
            raise ApiError(400, f"{p}temperature must be in [0, 2]", f"{p}temperature", "invalid_value")
        if not 0 < body.top_p <= 1:
            raise ApiError(400, f"{p}top_p must be in (0, 1]", f"{p}top_p", "invalid_value")
        if getattr(body, "n", 1) != 1:
            raise ApiError(400, "n: only n=1 is supported", "n", "invalid_value")
        for name, off in _OFF_VALUES.items():
            if name not in type(body).model_fields:
                continue  # an agent body has no OpenAI options
            value = getattr(body, name)
            if value not in off:
                raise ApiError(400, f"{name}: not supported by this server (give {off[0]!r} or leave it out)",
                               name, "unsupported_parameter")
        stop = () if self.prompter.eos_token_id is None else (self.prompter.eos_token_id,)
        return SamplingSpec(max_tokens=max_tokens, temperature=float(body.temperature), top_p=float(body.top_p),
                            seed=body.seed, stop_token_ids=stop)

    def _check_length(self, ids: list[int], sampling: SamplingSpec, limit: int, param: str,
                      mt_param: str = "max_tokens") -> None:
        if not ids:
            raise ApiError(400, f"{param} is empty", param, "invalid_value")
        if len(ids) >= limit:
            raise ApiError(400, f"{param} has {len(ids)} tokens; this model's context is {limit} tokens",
                           param, "context_length_exceeded")
        if len(ids) + sampling.max_tokens > limit:
            raise ApiError(400, f"{param} ({len(ids)} tokens) + {mt_param} ({sampling.max_tokens}) exceeds "
                           f"the context of {limit} tokens", mt_param, "context_length_exceeded")

    # --- routes ---
    @api.get("/healthz")
    async def healthz(self):
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self):
        data = []
        for d in self.plan.decoders:
            data.append({"id": d.name, "object": "model", "created": self.created, "owned_by": "prefillshare",
                         "prefill_module": d.prefill_module, "private_prefill_reason": d.private_detail})
        return {"object": "list", "data": data}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        body, tenant = await self._accept(request, CompletionBody)
        dp = self._decoder(body.model)
        sampling = self._sampling(body, body.max_tokens)
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
            if len(body.prompt) != 1:
                raise ApiError(400, "prompt: batches of prompts are not supported; send one", "prompt",
                               "invalid_value")
            body.prompt = body.prompt[0]
        if isinstance(body.prompt, str):
            if not body.prompt.strip():
                raise ApiError(400, "prompt is empty", "prompt", "invalid_value")
            ids = self.prompter.encode(body.prompt)
        else:
            ids = list(body.prompt)
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.prompter.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"prompt[{bad}]: token id {ids[bad]} is outside the vocabulary "
                               f"[0, {self.prompter.vocab_size})", "prompt", "invalid_value")
        self._check_length(ids, sampling, dp.max_model_len, "prompt")
        job = CompletionJob(f"cmpl-{uuid.uuid4().hex}", body.model, tuple(ids), sampling, "completions",
                            cache_salt=tenant.salt if tenant else None)
        return await self._serve_completion(job, body, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        body, tenant = await self._accept(request, ChatBody)
        dp = self._decoder(body.model)
        mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        mt_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        try:
            sampling = self._sampling(body, mt)
        except ApiError as e:
            if e.param == "max_tokens":
                e.param, e.message = mt_param, e.message.replace("max_tokens", mt_param, 1)
            raise
        last = body.messages[-1]
        if last.role != "user":
            raise ApiError(400, "messages: the last message must have role 'user'",
                           f"messages[{len(body.messages) - 1}].role", "invalid_value")
        for i, m in enumerate(body.messages):
            if not m.content.strip() and i == len(body.messages) - 1:
                raise ApiError(400, f"messages[{i}].content is empty", f"messages[{i}].content", "invalid_value")
        ids = self.prompter.chat_prompt([(m.role, m.content) for m in body.messages])
        self._check_length(ids, sampling, dp.max_model_len, "messages", mt_param)
        job = CompletionJob(f"chatcmpl-{uuid.uuid4().hex}", body.model, tuple(ids), sampling, "chat",
                            cache_salt=tenant.salt if tenant else None)
        return await self._serve_completion(job, body, chat=True)

    async def _serve_completion(self, job: CompletionJob, body, chat: bool):
        """Admit, then run; the first chunk is awaited here so that a shed request still gets
        a 429 status line (a stream's status is fixed once it starts)."""
        slot = self._admit(job.route)
        gen = self.orch.options(stream=True).complete.remote(job)
        streaming = False
        outcome: Outcome = "failed"
        try:
            first = await self._first(gen)
            if first.error:
                return _engine_error(first.error, self.limits.retry_after_s)
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            if body.stream:
                streaming = True
                return StreamingResponse(self._sse(job, first, gen, chat, include_usage, slot),
                                         media_type="text/event-stream")
            text, finish, last = first.delta_text, first.finish_reason, first
            async for chunk in gen:
                if chunk.error:
                    return _engine_error(chunk.error, self.limits.retry_after_s)
                text += chunk.delta_text
                finish, last = chunk.finish_reason, chunk
            outcome = "completed"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if not streaming:
                slot.release(outcome)
        usage = _usage(job, last)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {"id": job.request_id, "object": obj, "created": int(time.time()), "model": job.model,
                "choices": [choice], "usage": usage,
                "prefillshare": {"prefill_module": getattr(last, "prefill_module", None),
                                 "prefill_replica": getattr(last, "prefill_replica", None)}}

    async def _sse(self, job: CompletionJob, head, gen, chat: bool, include_usage: bool, slot: Slot):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        last = None
        first = True
        finished = False
        outcome: Outcome = "cancelled"  # unless the stream ends: the client went away
        try:
            async for chunk in _chain(head, gen):
                if chunk.error:
                    outcome = "failed"
                    err = _engine_error(chunk.error)
                    yield f"data: {err.body.decode()}\n\n"
                    break
                last = chunk
                if chat:
                    delta: dict[str, Any] = {"content": chunk.delta_text}
                    if first:
                        delta["role"] = "assistant"
                    choice = {"index": 0, "delta": delta, "finish_reason": chunk.finish_reason if chunk.finished else None,
                              "logprobs": None}
                else:
                    choice = {"index": 0, "text": chunk.delta_text,
                              "finish_reason": chunk.finish_reason if chunk.finished else None, "logprobs": None}
                first = False
                yield "data: " + json.dumps({"id": job.request_id, "object": obj, "created": created,
                                             "model": job.model, "choices": [choice]}) + "\n\n"
            if include_usage and last is not None:
                yield "data: " + json.dumps({"id": job.request_id, "object": obj, "created": created,
                                             "model": job.model, "choices": [], "usage": _usage(job, last)}) + "\n\n"
            finished = True
            if outcome != "failed":
                outcome = "completed"
        except Exception as e:  # noqa: BLE001 - the stream is already open; report in-band
            outcome = "failed"
            yield "data: " + json.dumps(error_body(f"internal error: {e}", "server_error", None, "internal")) + "\n\n"
        finally:  # also on a client disconnect (the generator is cancelled): free the slot, stop the engines
            slot.release(outcome)
            if not finished:
                gen.cancel()
        yield "data: [DONE]\n\n"

    @api.post("/v1/agents/run")
    async def agents_run(self, request: Request):
        body, tenant = await self._accept(request, AgentRunBody)
        if not body.context.strip():
            raise ApiError(400, "context is empty", "context", "invalid_value")
        if isinstance(body.rounds, list):
            if body.agents is not None:
                raise ApiError(400, "give either agents (with rounds as a count) or rounds as a list of agent lists",
                               "agents", "invalid_value")
            raw_rounds, prefix = body.rounds, "rounds"
        else:
            if not body.agents:
                raise ApiError(400, "agents: give at least one agent", "agents", "invalid_value")
            n = 1 if body.rounds is None else body.rounds
            if not 1 <= n <= self.plan.max_rounds:
                raise ApiError(400, f"rounds must be in [1, {self.plan.max_rounds}]", "rounds", "invalid_value")
            raw_rounds, prefix = [body.agents] * n, None
        if len(raw_rounds) > self.plan.max_rounds:
            raise ApiError(400, f"rounds: at most {self.plan.max_rounds}", "rounds", "invalid_value")
        rounds = []
        for r, agents in enumerate(raw_rounds):
            if not agents:
                raise ApiError(400, f"rounds[{r}]: give at least one agent", f"rounds[{r}]", "invalid_value")
            if len(agents) > self.plan.max_agents:
                raise ApiError(400, f"at most {self.plan.max_agents} agents per round", "agents", "invalid_value")
            specs, names = [], set()
            for i, a in enumerate(agents):
                p = f"rounds[{r}][{i}]." if prefix else f"agents[{i}]."
                dp = self._decoder(a.model, p + "model")
                if not a.instruction.strip():
                    raise ApiError(400, f"{p}instruction is empty", p + "instruction", "invalid_value")
                name = a.name or a.model
                if name in names:
                    raise ApiError(400, f"{p}name: {name!r} appears twice in one round; give agents distinct names",
                                   p + "name", "invalid_value")
                names.add(name)
                sampling = self._sampling(a, a.max_tokens, p)
                if r == 0:
                    ids = self.prompter.agent_prompt(body.context, a.instruction)
                    self._check_length(ids, sampling, dp.max_model_len, "context", p + "max_tokens")
                specs.append(AgentSpec(name, a.model, a.instruction, sampling))
            rounds.append(tuple(specs))
        req = AgentRunRequest(f"run-{uuid.uuid4().hex}", body.context, tuple(rounds), body.join_outputs,
                              cache_salt=tenant.salt if tenant else None)
        slot = self._admit("agents")
        gen = self.orch.options(stream=True).run.remote(req)
        streaming = False
        outcome: Outcome = "failed"
        try:
            head = await self._first(gen)
            if body.stream:
                streaming = True
                return StreamingResponse(self._agent_sse(req, head, gen, slot), media_type="text/event-stream")
            final = head.result if head.kind == "done" else None
            async for ev in gen:
                if ev.kind == "done":
                    final = ev.result
            outcome = "completed" if final is not None else "failed"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if not streaming:
                slot.release(outcome)
        return {"id": req.request_id, "object": "agents.run", "created": int(time.time()), **(final or {})}

    async def _agent_sse(self, req: AgentRunRequest, head, gen, slot: Slot):
        finished = False
        outcome: Outcome = "cancelled"  # unless the stream ends: the client went away
        try:
            async for ev in _chain(head, gen):
                out: dict[str, Any] = {"id": req.request_id, "type": ev.kind, "round": ev.round}
                if ev.kind == "delta":
                    out.update(agent=ev.agent, model=ev.model, text=ev.delta_text)
                elif ev.kind == "agent_done":
                    out.update(agent=ev.agent, model=ev.model, result=ev.result)
                else:
                    out.update(ev.result)
                yield "data: " + json.dumps(out) + "\n\n"
            finished = True
            outcome = "completed"
        except Exception as e:  # noqa: BLE001
            outcome = "failed"
            yield "data: " + json.dumps(error_body(f"internal error: {e}", "server_error", None, "internal")) + "\n\n"
        finally:
            slot.release(outcome)
            if not finished:
                gen.cancel()
        yield "data: [DONE]\n\n"

    @api.get("/ready")
    async def ready(self):
        """200 when every engine deployment is healthy and answers a probe; 503 otherwise."""
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
        probes.update({f"decoder:{k}": h for k, h in self.decoders.items()})
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
        return {"ready": True, "engines": len(self.prefill) + len(self.decoders),
                "admission": self.admission.snapshot()}

    @api.get("/metrics")
    async def metrics_text(self):
        body = await self.metrics.render.remote()
        return Response(content=body, media_type="text/plain; version=0.0.4; charset=utf-8")
