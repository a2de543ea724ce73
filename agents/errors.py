"""Exceptions the SDK raises; each carries the server's own message and error fields.

The app answers errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`
(docs/DESIGN.md); `error_from_response` turns that into the most specific class so callers
can `except ModelNotFoundError` instead of parsing strings.
"""
from __future__ import annotations

import json
from typing import Any


class PrefillShareError(Exception):
    """Base of every SDK error."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class APIConnectionError(PrefillShareError):
    """No HTTP answer: refused, reset, DNS. Safe to retry only if the request was not sent."""


class APITimeoutError(APIConnectionError):
    """The server did not answer (or stopped streaming) within the timeout."""


class APIStatusError(PrefillShareError):
    """The server answered with an error status; fields come from its error object."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None,
                 code: str | None = None, body: Any = None):
        super().__init__(f"HTTP {status}: {message}")
        self.message = message
        self.status = status
        self.type = type_
        self.param = param
        self.code = code
        self.body = body


class BadRequestError(APIStatusError):
    """400/422: the request is wrong; `param` names the field."""


class ContextLengthError(BadRequestError):
    """The prompt (context + instruction) plus max_tokens exceeds the model's context."""


class AuthenticationError(APIStatusError):
    """401/403."""


class NotFoundError(APIStatusError):
    """404: unknown route or resource."""


class ModelNotFoundError(NotFoundError):
    """The `model` (decoder / agent) is not served; the message lists the served ones."""


class RateLimitError(APIStatusError):
    """429."""


class ServerError(APIStatusError):
    """5xx."""


class ServiceUnavailableError(ServerError):
    """503: an engine failed or is not ready."""


class StreamError(PrefillShareError):
    """The server reported an error inside an already-open event stream."""

    def __init__(self, message: str, type_: str | None = None, code: str | None = None):
        super().__init__(message)
        self.type = type_
        self.code = code


class AgentFailedError(PrefillShareError):
    """One or more agents of a run failed (the others completed); `failures` holds them."""

    def __init__(self, failures: tuple):
        self.failures = failures
        detail = "; ".join(f"round {f.round} {f.name}: {f.error}" for f in failures)
        super().__init__(f"{len(failures)} agent(s) failed: {detail}")


class WorkflowError(PrefillShareError, ValueError):
    """A workflow or agent definition that cannot be sent (names the agent and field)."""


def _status_class(status: int, code: str | None) -> type[APIStatusError]:
    if status in (400, 422):
        return ContextLengthError if code == "context_length_exceeded" else BadRequestError
    if status in (401, 403):
        return AuthenticationError
    if status == 404:
        return ModelNotFoundError if code == "model_not_found" else NotFoundError
    if status == 429:
        return RateLimitError
    if status == 503:
        return ServiceUnavailableError
    if status >= 500:
        return ServerError
    return APIStatusError


def error_from_response(status: int, content: bytes) -> APIStatusError:
    """The typed error for an HTTP error answer; non-JSON bodies keep their text as message."""
    text = content.decode("utf-8", "replace")
    body: Any = None
    try:
        body = json.loads(text)
    except ValueError:
        pass
    message, type_, param, code = text.strip() or f"HTTP {status}", None, None, None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            type_, param, code = err.get("type"), err.get("param"), err.get("code")
        elif "detail" in body:  # FastAPI's own errors (unknown route, method)
            message = str(body["detail"])
    return _status_class(status, code)(status, message, type_, param, code, body)
