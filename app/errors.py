"""The one root of the library's exceptions (app/ and deployments/).

``except PrefillShareLibraryError`` catches whatever the library raises on purpose; each typed
subclass also keeps its builtin base (ValueError, KeyError, PermissionError, ...), so code that
catches those still does. The SDK's errors (agents/errors.py, rooted at ``prefillshare.agents.PrefillShareError``)
are what a client sees over HTTP and stay apart from these.
"""
from __future__ import annotations

__all__ = ["PrefillShareLibraryError"]


class PrefillShareLibraryError(Exception):
    """Base class of every exception app/ and deployments/ define."""
