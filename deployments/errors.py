"""Errors between deployments and at the edge: one code per failure kind, one table to HTTP.

A decoder, the orchestrator or the prefill path reports a failure as a :class:`Failure`
(an :class:`ErrorCode` and a readable message) inside the stream it was answering; the Router
turns it into an HTTP answer (or an in-band SSE error once a stream has started) through
:data:`HTTP` and :meth:`ApiError.from_failure`, the only place that knows statuses, OpenAI error
types, Retry-After and which field of the route a failure names (:data:`INPUT_FIELD`); an agent
run's result carries the code itself (:func:`failure_fields`). Client errors the Router finds
itself are :class:`ApiError` with the field named. :class:`Shed` and :class:`Unreachable` are
what the engine adapter (deployments/path/serve_engines.py) raises to the request path.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from prefillshare.app.errors import PrefillShareLibraryError


class ErrorCode(enum.Enum):
    INVALID_REQUEST = "invalid_request"  # the engine refused the request (bad sampling, bad prompt)
    CONTEXT_LENGTH = "context_length_exceeded"  # a later round's prompt outgrew the decoder's context
    OVERLOADED = "overloaded"  # a deployment's queue is full (Serve's back-pressure)
    DECODER_UNAVAILABLE = "decoder_unavailable"  # the decoder replica died or cannot be reached
    ENGINE_ERROR = "engine_error"  # the engine failed while running the request
    TIMEOUT = "timeout"  # the request outlived limits.request_timeout_s (counted from its admission)


@dataclass(frozen=True)
class Failure:
    """A failure reported in a stream (DecodeChunk.error, an agent's result)."""

    code: ErrorCode
    message: str
    retry_after_s: int | None = None  # when known better than limits.retry_after_s (a decoder starting from zero)

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class Shed(PrefillShareLibraryError):
    """A deployment refused a call because its queue is full (Serve's back-pressure)."""


class Unreachable(PrefillShareLibraryError):
    """No replica of a deployment took a call in time (its node is gone, or none is up)."""


@dataclass(frozen=True)
class HttpShape:
    status: int
    type: str  # OpenAI's error type
    code: str  # the `code` field of the error object
    retry_after: bool  # send Retry-After (the client may retry the same request)
    about_input: bool = False  # the failure is the request's input: `param` names the route's input field


HTTP: dict[ErrorCode, HttpShape] = {
    ErrorCode.INVALID_REQUEST: HttpShape(400, "invalid_request_error", "invalid_value", False, about_input=True),
    ErrorCode.CONTEXT_LENGTH: HttpShape(400, "invalid_request_error", "context_length_exceeded", False,
                                        about_input=True),
    ErrorCode.OVERLOADED: HttpShape(429, "rate_limit_error", "overloaded", True),
    ErrorCode.DECODER_UNAVAILABLE: HttpShape(503, "server_error", "engine_error", True),
    ErrorCode.ENGINE_ERROR: HttpShape(503, "server_error", "engine_error", True),
    ErrorCode.TIMEOUT: HttpShape(504, "server_error", "timeout", True),
}

# The body field each generation route's prompt comes from: the `param` of a failure about the input.
INPUT_FIELD: dict[str, str] = {"completions": "prompt", "chat": "messages", "agents": "context"}


def failure_fields(failure: Failure | None) -> dict[str, str | None]:
    """An agent result's error fields: the readable failure and its typed code (None when it ran)."""
    return {"error": None if failure is None else str(failure),
            "error_code": None if failure is None else failure.code.value}


def error_body(message: str, type_: str, param: str | None, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(PrefillShareLibraryError):
    """A client error: HTTP status and OpenAI's error object (plus headers such as Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None, code: str,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    @classmethod
    def invalid(cls, param: str | None, message: str, code: str = "invalid_value") -> ApiError:
        return cls(400, message, param, code)

    @classmethod
    def from_failure(cls, failure: Failure, route: str, retry_after_s: int) -> ApiError:
        """The HTTP answer to ``failure`` on ``route`` ("completions" | "chat" | "agents")."""
        shape = HTTP[failure.code]
        wait = failure.retry_after_s if failure.retry_after_s is not None else retry_after_s
        headers = {"Retry-After": str(wait)} if shape.retry_after else None
        param = INPUT_FIELD[route] if shape.about_input else None
        return cls(shape.status, str(failure), param, shape.code, shape.type, headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self):
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=self.status, content=self.body(), headers=self.headers)
