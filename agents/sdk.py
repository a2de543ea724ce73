"""Python clients for the PrefillShare Serve app: `Client` (blocking) and `AsyncClient`.

One call sends one shared context to several agents (decoders); the app prefills the context
once on the shared base and fans it out. Both clients speak the app's HTTP API
(docs/DESIGN.md): POST /v1/agents/run (whole result, or server-sent events with
`stream=True`), the OpenAI completion routes, /v1/models, /ready.

Retries: GETs are idempotent and are retried on connection errors, timeouts and 429/502/503/504
with exponential backoff (honouring Retry-After). A POST is retried only when it provably never
reached the server (connection refused / connect timeout) or on 429; a generation that may have
started is never sent twice behind the caller's back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import httpx

from .errors import (
    APIConnectionError,
    APITimeoutError,
    PrefillShareError,
    StreamError,
    WorkflowError,
    error_from_response,
)
from .sampling import StructuredOutput
from .types import (
    AgentDelta,
    AgentDone,
    AgentResult,
    Completion,
    ModelInfo,
    Readiness,
    RoundDone,
    RunDone,
    RunEvent,
    RunResult,
    RunUsage,
    Timings,
    Usage,
    parse_agent_result,
    parse_run,
)
from .workflow import Agent, Join, Sampling, Workflow

AgentLike = Agent | Mapping[str, Any]
_RETRY_STATUS = {429, 502, 503, 504}


# ---- request bodies ------------------------------------------------------------------------

def _agent(a: AgentLike) -> Agent:
    if isinstance(a, Agent):
        return a
    if isinstance(a, Mapping):
        d = dict(a)
        fields = {f.name for f in dataclasses.fields(Sampling)}
        options = {k: d.pop(k) for k in list(d) if k in fields}
        if "response_format" in d:
            options["structured"] = _structured(d.pop("response_format"))
        try:
            sampling = Sampling(**options)
        except TypeError as e:
            raise WorkflowError(f"agent {a!r}: {e}") from None
        try:
            return Agent(sampling=sampling, **d)
        except TypeError as e:
            raise WorkflowError(f"agent {a!r}: {e}") from None
    raise WorkflowError(f"an agent is an Agent or a mapping, got {type(a).__name__}")


def _structured(response_format: Any) -> StructuredOutput | None:
    """An OpenAI response_format mapping -> the constraint (text: none)."""
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    schema = (response_format.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if not isinstance(schema, Mapping):
        raise WorkflowError(f"response_format: give {{'type': 'json_object'}} or {{'type': 'json_schema', "
                            f"'json_schema': {{'name': ..., 'schema': {{...}}}}}}, got {response_format!r}")
    return StructuredOutput.for_schema(dict(schema))


def run_body(context: str, agents: Sequence[AgentLike], rounds: int = 1, join_outputs: bool = True,
             stream: bool = False, variables: Mapping[str, Any] | None = None,
             cache_salt: str | None = None) -> dict[str, Any]:
    """JSON for POST /v1/agents/run: the same agents for `rounds` rounds. ``cache_salt`` salts the
    run's shared context (vLLM's field; the app joins it with the API key's tenant salt)."""
    if not agents:
        raise WorkflowError("give at least one agent")
    parsed = [_agent(a).render(variables) for a in agents]
    labels = [a.label for a in parsed]
    if len(set(labels)) != len(labels):
        raise WorkflowError(f"agent names repeat: {labels}; give each a distinct name")
    body = {"context": context, "agents": [a.to_json() for a in parsed], "rounds": rounds,
            "join_outputs": join_outputs, "stream": stream}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def workflow_body(workflow: Workflow, context: str, variables: Mapping[str, Any] | None = None,
                  stream: bool = False) -> dict[str, Any]:
    """JSON for a server-side workflow: explicit rounds, joined by the app (or not at all)."""
    if not workflow.server_side:
        raise WorkflowError("this workflow joins on the client; run it with run_workflow()")
    rounds = [[a.to_json() for a in r] for r in workflow.rendered(variables)]
    return {"context": context, "rounds": rounds, "join_outputs": workflow.join is Join.SERVER, "stream": stream}


# ---- event streams -------------------------------------------------------------------------

class _SSEDecoder:
    """Server-sent events, line by line -> the `data` payload of each complete event."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> list[str]:
        line = line.rstrip("\r\n")
        if not line:
            out = ["\n".join(self._data)] if self._data else []
            self._data = []
            return out
        if line.startswith(":"):
            return []
        key, _, value = line.partition(":")
        if key == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return []

    def flush(self) -> list[str]:
        return self.feed("")


class _EventAssembler:
    """JSON events of one agent run -> typed events, with client-side timings per agent."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.first: dict[tuple[int, str], float] = {}
        self.timings: dict[tuple[int, str], Timings] = {}
        self.result: RunResult | None = None

    def _timing(self, round_: int, agent: str) -> Timings:
        t = Timings(self.first.get((round_, agent)), time.perf_counter() - self.t0)
        self.timings[(round_, agent)] = t
        return t

    def feed(self, obj: dict[str, Any]) -> list[RunEvent]:
        if "error" in obj and isinstance(obj["error"], dict):
            err = obj["error"]
            raise StreamError(str(err.get("message")), err.get("type"), err.get("code"))
        kind, r = obj.get("type"), int(obj.get("round", 0))
        if kind == "delta":
            now = time.perf_counter() - self.t0
            self.first.setdefault((r, obj.get("agent", "")), now)
            return [AgentDelta(r, obj.get("agent", ""), obj.get("model", ""), obj.get("text", ""), now)]
        if kind == "agent_done":
            res = obj.get("result") or {}
            name = str(res.get("name") or obj.get("agent", ""))
            return [AgentDone(r, parse_agent_result(res, self._timing(r, name)))]
        if kind == "round_done":
            results = tuple(
                parse_agent_result(a, self.timings.get((r, str(a.get("name", ""))))) for a in obj.get("agents") or []
            )
            return [RoundDone(r, results)]
        if kind == "done":
            self.result = parse_run(obj, time.perf_counter() - self.t0, self.timings)
            return [RunDone(self.result)]
        return []  # unknown event kinds from a newer server are skipped


def _parse_models(data: dict) -> list[ModelInfo]:
    return [ModelInfo(str(m["id"]), m.get("prefill_module"), m.get("private_prefill_reason"))
            for m in data.get("data") or []]


def _parse_completion(d: dict, elapsed: float) -> Completion:
    choice = (d.get("choices") or [{}])[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("message") or {}).get("content", "")
    u = d.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    return Completion(str(d.get("id", "")), str(d.get("model", "")), text or "", choice.get("finish_reason"),
                      Usage(int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)), int(cached)), elapsed)


def _merge_rounds(parts: list[RunResult], final_context: str, elapsed: float) -> RunResult:
    results: list[AgentResult] = []
    usage = RunUsage()
    for r, part in enumerate(parts):
        results += [_with_round(x, r) for x in part.results]
        usage = usage + part.usage
    return RunResult(",".join(p.id for p in parts), tuple(results), usage, final_context, elapsed)


def _with_round(res: AgentResult, r: int) -> AgentResult:
    return replace(res, round=r)


# ---- shared settings -----------------------------------------------------------------------

class _Settings:
    def __init__(self, base_url: str, api_key: str | None, timeout: float, connect_timeout: float,
                 retries: int, backoff_s: float, max_backoff_s: float):
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.headers = {"Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s

    def per_call(self, timeout: float | None):
        """A call's own timeout, or the client's (None must not mean 'wait forever')."""
        return httpx.Timeout(timeout, connect=self.timeout.connect) if timeout else httpx.USE_CLIENT_DEFAULT

    def delay(self, attempt: int, response: httpx.Response | None) -> float:
        d = min(self.max_backoff_s, self.backoff_s * (2 ** attempt))
        if response is not None:
            try:
                d = max(d, min(self.max_backoff_s * 4, float(response.headers.get("retry-after", 0))))
            except ValueError:
                pass
        return d

    def retry_on_error(self, exc: httpx.HTTPError, idempotent: bool) -> bool:
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return True  # the request never reached the server
        return idempotent and isinstance(exc, (httpx.TimeoutException, httpx.TransportError))

    @staticmethod
    def retry_on_status(status: int, idempotent: bool) -> bool:
        return status in _RETRY_STATUS if idempotent else status == 429

    @staticmethod
    def wrap(exc: httpx.HTTPError) -> PrefillShareError:
        if isinstance(exc, httpx.TimeoutException):
            return APITimeoutError(f"timed out: {type(exc).__name__}: {exc}")
        return APIConnectionError(f"{type(exc).__name__}: {exc}")


class _Retry:
    """One request's retry decisions (sans I/O): both clients send, then ask what to do."""

    def __init__(self, s: _Settings, method: str):
        self.s, self.idempotent, self.attempt = s, method == "GET", 0

    def after_error(self, exc: httpx.HTTPError) -> float:
        """Seconds to wait before the next try; raises the SDK's error when there is none."""
        if self.attempt < self.s.retries and self.s.retry_on_error(exc, self.idempotent):
            return self._next(None)
        raise self.s.wrap(exc) from exc

    def after_status(self, resp: httpx.Response, content: bytes) -> float:
        if self.attempt < self.s.retries and self.s.retry_on_status(resp.status_code, self.idempotent):
            return self._next(resp)
        raise error_from_response(resp.status_code, content)

    def _next(self, resp: httpx.Response | None) -> float:
        d = self.s.delay(self.attempt, resp)
        self.attempt += 1
        return d


def _readiness(d: dict) -> Readiness:
    return Readiness(bool(d.get("ready")), tuple(d.get("problems") or ()), d.get("engines"), tuple(d.get("asleep") or ()))


def _not_ready(e: PrefillShareError) -> Readiness:
    """A 503 from /ready is an answer (engines not ready), not an error; anything else re-raises."""
    body = getattr(e, "body", None)
    if getattr(e, "status", None) == 503 and isinstance(body, dict) and "ready" in body:
        return Readiness(False, tuple(body.get("problems") or ()))
    raise e


class _ReadyWait:
    """wait_ready's bookkeeping: until ready or ``timeout_s``; the last answer for the error."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.last: Readiness | PrefillShareError | None = None

    def pending(self) -> bool:
        return time.monotonic() < self.deadline

    def done(self, answer: Readiness | PrefillShareError) -> bool:
        self.last = answer
        return isinstance(answer, Readiness) and answer.ready

    def timed_out(self) -> APITimeoutError:
        return APITimeoutError(f"app not ready after {self.timeout_s:.0f} s: {self.last}")


def _completion_body(model: str, prompt: str, max_tokens: int | None, temperature: float,
                     options: Mapping[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "temperature": temperature, **options}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def _chat_body(model: str, messages: Sequence[Mapping[str, Any]], max_tokens: int | None, temperature: float,
               options: Mapping[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": list(messages), "temperature": temperature, **options}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


# ---- blocking client -----------------------------------------------------------------------

class _Connection:
    """The settings and HTTP client both clients are built from: one constructor signature."""

    _http_class: type[httpx.Client] | type[httpx.AsyncClient]

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: float = 120.0, connect_timeout: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.25, max_backoff_s: float = 4.0):
        self._s = _Settings(base_url, api_key, timeout, connect_timeout, retries, backoff_s, max_backoff_s)
        self._http = self._http_class(base_url=self._s.base_url, headers=self._s.headers, timeout=self._s.timeout)


class Client(_Connection):
    """Blocking client. `Client(url)` then `run(context, agents=[...])`."""

    _http_class = httpx.Client
    _http: httpx.Client

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, body: Any = None, *, stream: bool = False,
                 timeout: float | None = None) -> httpx.Response:
        retry = _Retry(self._s, method)
        while True:
            try:
                req = self._http.build_request(method, path, json=body, timeout=self._s.per_call(timeout))
                resp = self._http.send(req, stream=stream)
            except httpx.HTTPError as e:
                time.sleep(retry.after_error(e))
                continue
            if resp.status_code < 400:
                return resp
            content = resp.read()
            resp.close()
            time.sleep(retry.after_status(resp, content))

    def _json(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> dict:
        resp = self._request(method, path, body, timeout=timeout)
        try:
            return resp.json()
        except ValueError as e:
            raise PrefillShareError(f"{path}: the server answered non-JSON: {resp.text[:200]!r}") from e

    # -- service --
    def models(self) -> list[ModelInfo]:
        return _parse_models(self._json("GET", "/v1/models"))

    def health(self) -> bool:
        return self._json("GET", "/healthz").get("status") == "ok"

    def ready(self) -> Readiness:
        """Whether every engine answers (503 is an answer here, not an error)."""
        try:
            return _readiness(self._json("GET", "/ready"))
        except PrefillShareError as e:
            return _not_ready(e)

    def wait_ready(self, timeout_s: float = 300.0, interval_s: float = 2.0) -> Readiness:
        wait = _ReadyWait(timeout_s)
        while wait.pending():
            try:
                answer: Readiness | PrefillShareError = self.ready()
            except PrefillShareError as e:
                answer = e
            if wait.done(answer):
                return answer  # type: ignore[return-value]
            time.sleep(interval_s)
        raise wait.timed_out()

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text

    # -- OpenAI routes --
    def complete(self, model: str, prompt: str, *, max_tokens: int | None = None, temperature: float = 0.0,
                 timeout: float | None = None, **options: Any) -> Completion:
        """POST /v1/completions; ``options`` are further OpenAI fields (stop, n, logprobs, seed, ...)."""
        t0 = time.perf_counter()
        d = self._json("POST", "/v1/completions", _completion_body(model, prompt, max_tokens, temperature, options),
                       timeout)
        return _parse_completion(d, time.perf_counter() - t0)

    def chat(self, model: str, messages: Sequence[Mapping[str, Any]], *, max_tokens: int | None = None,
             temperature: float = 0.0, timeout: float | None = None, **options: Any) -> Completion:
        """POST /v1/chat/completions; ``options`` as for complete (response_format, tools, ...)."""
        t0 = time.perf_counter()
        d = self._json("POST", "/v1/chat/completions", _chat_body(model, messages, max_tokens, temperature, options),
                       timeout)
        return _parse_completion(d, time.perf_counter() - t0)

    # -- agents --
    def run(self, context: str, agents: Sequence[AgentLike], *, rounds: int = 1, join_outputs: bool = True,
            variables: Mapping[str, Any] | None = None, timeout: float | None = None,
            cache_salt: str | None = None) -> RunResult:
        """Fan `context` out to `agents` (concurrently), for `rounds` rounds."""
        return self._run(run_body(context, agents, rounds, join_outputs, False, variables, cache_salt), timeout)

    def _run(self, body: dict, timeout: float | None) -> RunResult:
        t0 = time.perf_counter()
        d = self._json("POST", "/v1/agents/run", body, timeout)
        return parse_run(d, time.perf_counter() - t0)

    def stream(self, context: str, agents: Sequence[AgentLike], *, rounds: int = 1, join_outputs: bool = True,
               variables: Mapping[str, Any] | None = None, timeout: float | None = None,
               cache_salt: str | None = None) -> Iterator[RunEvent]:
        """Events as they happen: AgentDelta ..., AgentDone, RoundDone, and RunDone last."""
        return self._stream(run_body(context, agents, rounds, join_outputs, True, variables, cache_salt), timeout)

    def _stream(self, body: dict, timeout: float | None) -> Iterator[RunEvent]:
        t0 = time.perf_counter()
        resp = self._request("POST", "/v1/agents/run", body, stream=True, timeout=timeout)
        asm, dec = _EventAssembler(t0), _SSEDecoder()
        try:
            for line in resp.iter_lines():
                for payload in dec.feed(line):
                    if payload == "[DONE]":
                        return
                    yield from asm.feed(json.loads(payload))
        except httpx.HTTPError as e:
            raise self._s.wrap(e) from e
        finally:
            resp.close()
        if asm.result is None:
            raise StreamError("the event stream ended before the run finished")

    def run_workflow(self, workflow: Workflow, context: str, variables: Mapping[str, Any] | None = None,
                     *, timeout: float | None = None) -> RunResult:
        """All rounds in one request when the app joins; one request per round for a custom join."""
        if workflow.server_side:
            return self._run(workflow_body(workflow, context, variables), timeout)
        t0, parts = time.perf_counter(), []
        for agents in workflow.rendered(variables):
            part = self._run(run_body(context, agents, 1, False), timeout)
            parts.append(part)
            context = workflow.join(context, part.results)  # type: ignore[operator]
        return _merge_rounds(parts, context, time.perf_counter() - t0)

    def stream_workflow(self, workflow: Workflow, context: str, variables: Mapping[str, Any] | None = None,
                        *, timeout: float | None = None) -> Iterator[RunEvent]:
        return self._stream(workflow_body(workflow, context, variables, stream=True), timeout)


# ---- asyncio client ------------------------------------------------------------------------

_END = object()


class RunStream:
    """An agent run in flight: iterate all events, or one agent's text with `agent(name)`.

    Use as `async with client.stream(...) as run:`. Every agent's deltas are buffered from the
    start, so per-agent iterators may be started late and consumed concurrently (one consumer
    per agent name). `await run.result()` waits for the end.
    """

    def __init__(self, client: AsyncClient, body: dict, timeout: float | None):
        self._client, self._body, self._timeout = client, body, timeout
        rounds = body["rounds"] if isinstance(body.get("rounds"), list) else []
        names = {a["name"] for a in body.get("agents") or []} | {a["name"] for r in rounds for a in r}
        self._agent_q: dict[str, asyncio.Queue] = {n: asyncio.Queue() for n in names}
        self._events: asyncio.Queue = asyncio.Queue()
        self._done = asyncio.Event()
        self._error: BaseException | None = None
        self._result: RunResult | None = None
        self._task: asyncio.Task | None = None
        self._resp: httpx.Response | None = None

    async def __aenter__(self) -> RunStream:
        t0 = time.perf_counter()
        self._resp = await self._client._request("POST", "/v1/agents/run", self._body, stream=True,
                                                 timeout=self._timeout)
        self._task = asyncio.create_task(self._pump(t0))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing
                pass
        if self._resp is not None:
            await self._resp.aclose()

    async def _pump(self, t0: float) -> None:
        asm, dec = _EventAssembler(t0), _SSEDecoder()
        try:
            async for line in self._resp.aiter_lines():  # type: ignore[union-attr]
                for payload in dec.feed(line):
                    if payload == "[DONE]":
                        return
                    for ev in asm.feed(json.loads(payload)):
                        await self._events.put(ev)
                        if isinstance(ev, (AgentDelta, AgentDone)):
                            name = ev.agent if isinstance(ev, AgentDelta) else ev.result.name
                            q = self._agent_q.setdefault(name, asyncio.Queue())
                            await q.put(ev)
                        if isinstance(ev, RunDone):
                            self._result = ev.result
            if asm.result is None:
                raise StreamError("the event stream ended before the run finished")
        except httpx.HTTPError as e:
            self._error = _Settings.wrap(e)
        except BaseException as e:  # noqa: BLE001 - handed to every consumer
            self._error = e
        finally:
            self._done.set()
            await self._events.put(_END)
            for q in self._agent_q.values():
                await q.put(_END)

    def _raise(self) -> None:
        if self._error is not None and not isinstance(self._error, asyncio.CancelledError):
            raise self._error

    async def __aiter__(self) -> AsyncIterator[RunEvent]:
        while True:
            ev = await self._events.get()
            if ev is _END:
                self._raise()
                return
            yield ev

    def agent(self, name: str, round: int | None = None) -> AsyncIterator[str]:
        """Text deltas of one agent (all its rounds, or only `round`) until it finishes."""
        if name not in self._agent_q:
            raise KeyError(f"no agent {name!r} in this run (have {sorted(self._agent_q)})")
        return self._agent_texts(self._agent_q[name], name, round)

    async def _agent_texts(self, q: asyncio.Queue, name: str, round: int | None) -> AsyncIterator[str]:
        while True:
            ev = await q.get()
            if ev is _END:
                self._raise()
                return
            if round is not None and ev.round != round:
                continue
            if isinstance(ev, AgentDelta):
                yield ev.text
            elif round is not None and isinstance(ev, AgentDone):
                if ev.result.error:
                    raise StreamError(f"agent {name} failed: {ev.result.error}")
                return

    async def result(self) -> RunResult:
        await self._done.wait()
        self._raise()
        if self._result is None:
            raise StreamError("the run ended without a result")
        return self._result


class AsyncClient(_Connection):
    """asyncio client; same methods as `Client`, plus `stream()` -> RunStream."""

    _http_class = httpx.AsyncClient
    _http: httpx.AsyncClient

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, body: Any = None, *, stream: bool = False,
                       timeout: float | None = None) -> httpx.Response:
        retry = _Retry(self._s, method)
        while True:
            try:
                req = self._http.build_request(method, path, json=body, timeout=self._s.per_call(timeout))
                resp = await self._http.send(req, stream=stream)
            except httpx.HTTPError as e:
                await asyncio.sleep(retry.after_error(e))
                continue
            if resp.status_code < 400:
                return resp
            content = await resp.aread()
            await resp.aclose()
            await asyncio.sleep(retry.after_status(resp, content))

    async def _json(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> dict:
        resp = await self._request(method, path, body, timeout=timeout)
        try:
            return resp.json()
        except ValueError as e:
            raise PrefillShareError(f"{path}: the server answered non-JSON: {resp.text[:200]!r}") from e

    async def models(self) -> list[ModelInfo]:
        return _parse_models(await self._json("GET", "/v1/models"))

    async def ready(self) -> Readiness:
        try:
            return _readiness(await self._json("GET", "/ready"))
        except PrefillShareError as e:
            return _not_ready(e)

    async def health(self) -> bool:
        return (await self._json("GET", "/healthz")).get("status") == "ok"

    async def wait_ready(self, timeout_s: float = 300.0, interval_s: float = 2.0) -> Readiness:
        wait = _ReadyWait(timeout_s)
        while wait.pending():
            try:
                answer: Readiness | PrefillShareError = await self.ready()
            except PrefillShareError as e:
                answer = e
            if wait.done(answer):
                return answer  # type: ignore[return-value]
            await asyncio.sleep(interval_s)
        raise wait.timed_out()

    async def metrics(self) -> str:
        return (await self._request("GET", "/metrics")).text

    async def chat(self, model: str, messages: Sequence[Mapping[str, Any]], *, max_tokens: int | None = None,
                   temperature: float = 0.0, timeout: float | None = None, **options: Any) -> Completion:
        t0 = time.perf_counter()
        d = await self._json("POST", "/v1/chat/completions",
                             _chat_body(model, messages, max_tokens, temperature, options), timeout)
        return _parse_completion(d, time.perf_counter() - t0)

    async def complete(self, model: str, prompt: str, *, max_tokens: int | None = None, temperature: float = 0.0,
                       timeout: float | None = None, **options: Any) -> Completion:
        t0 = time.perf_counter()
        d = await self._json("POST", "/v1/completions",
                             _completion_body(model, prompt, max_tokens, temperature, options), timeout)
        return _parse_completion(d, time.perf_counter() - t0)

    async def run(self, context: str, agents: Sequence[AgentLike], *, rounds: int = 1, join_outputs: bool = True,
                  variables: Mapping[str, Any] | None = None, timeout: float | None = None,
                  cache_salt: str | None = None) -> RunResult:
        return await self._run(run_body(context, agents, rounds, join_outputs, False, variables, cache_salt), timeout)

    async def _run(self, body: dict, timeout: float | None) -> RunResult:
        t0 = time.perf_counter()
        d = await self._json("POST", "/v1/agents/run", body, timeout)
        return parse_run(d, time.perf_counter() - t0)

    def stream(self, context: str, agents: Sequence[AgentLike], *, rounds: int = 1, join_outputs: bool = True,
               variables: Mapping[str, Any] | None = None, timeout: float | None = None,
               cache_salt: str | None = None) -> RunStream:
        return RunStream(self, run_body(context, agents, rounds, join_outputs, True, variables, cache_salt), timeout)

    async def run_workflow(self, workflow: Workflow, context: str, variables: Mapping[str, Any] | None = None,
                           *, timeout: float | None = None) -> RunResult:
        if workflow.server_side:
            return await self._run(workflow_body(workflow, context, variables), timeout)
        t0, parts = time.perf_counter(), []
        for agents in workflow.rendered(variables):
            part = await self._run(run_body(context, agents, 1, False), timeout)
            parts.append(part)
            context = workflow.join(context, part.results)  # type: ignore[operator]
        return _merge_rounds(parts, context, time.perf_counter() - t0)

    def stream_workflow(self, workflow: Workflow, context: str, variables: Mapping[str, Any] | None = None,
                        *, timeout: float | None = None) -> RunStream:
        return RunStream(self, workflow_body(workflow, context, variables, stream=True), timeout)


__all__ = ["Client", "AsyncClient", "RunStream", "run_body", "workflow_body"]
