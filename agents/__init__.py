"""Python agent SDK for the PrefillShare Serve app: clients, typed results, workflows."""
from agents.errors import (
    AgentFailedError,
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    BadRequestError,
    ContextLengthError,
    ModelNotFoundError,
    NotFoundError,
    PrefillShareError,
    ServerError,
    ServiceUnavailableError,
    StreamError,
    WorkflowError,
)
from agents.sdk import AsyncClient, Client, RunStream
from agents.types import (
    AgentChoice,
    AgentDelta,
    AgentDone,
    AgentResult,
    Completion,
    ModelInfo,
    Readiness,
    RoundDone,
    RunDone,
    RunResult,
    RunUsage,
    Timings,
    Usage,
    one_line,
)
from agents.workflow import Agent, Join, Sampling, Workflow, join_lines
from app.sampling import StructuredOutput

__all__ = [n for n in dir() if not n.startswith("_")]
