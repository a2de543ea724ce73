"""Python agent SDK for the PrefillShare Serve app: clients, typed results, workflows.

Imported as ``prefillshare.agents`` (pyproject.toml maps this agents/ folder to that name):
``agents`` is the import name of OpenAI's Agents SDK (openai-agents).
"""
if __name__ != "prefillshare.agents":  # e.g. `import agents` with the repository root on sys.path
    raise ImportError(
        f"{__file__} is PrefillShare's SDK, imported as `prefillshare.agents`, not `{__name__}`: the name "
        "`agents` belongs to OpenAI's Agents SDK (openai-agents). This folder was found only because the "
        "repository root is on sys.path (the current directory?); run from another directory, or import "
        "prefillshare.agents")

from .errors import (
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
from .sampling import Sampling, SamplingError, StructuredOutput
from .sdk import AsyncClient, Client, RunStream
from .types import (
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
from .workflow import Agent, Join, Workflow, join_lines

__all__ = [n for n in dir() if not n.startswith("_")]
