"""One vLLM on both ends of a ``vllm-nixl`` pull: a producer's lease names its vLLM, a consumer of
another version refuses it.

With ``enforce_handshake_compat`` off (the decoders have other weights than the base) vLLM's
NIXL handshake no longer compares the two engines' vLLM versions, and two versions may lay out
or describe blocks differently. So the project's connector stamps the producer's version into
the ``kv_transfer_params`` a finished prefill returns (:func:`stamp`), and both the Decode
replica (before it sends the request) and the consumer's connector (before vLLM pairs with the
producer) refuse a lease of another version (:func:`refusal`): the decoder prefills privately
and the refusal, naming both versions, is logged and counted (``fallback:vllm_version``).
"""
from __future__ import annotations

import functools
from typing import Any

from prefillshare.app.errors import PrefillShareLibraryError

__all__ = ["VERSION_KEY", "VllmVersionMismatch", "vllm_version", "stamp", "refusal"]

VERSION_KEY = "prefillshare_vllm_version"


class VllmVersionMismatch(PrefillShareLibraryError, RuntimeError):
    """A producer and a consumer of one app run different vLLM versions."""

    def __init__(self, producer: str, consumer: str):
        self.producer, self.consumer = producer, consumer
        super().__init__(f"vLLM version mismatch: the producer runs vLLM {producer}, this consumer vLLM {consumer}; "
                         "every engine of an app must run the same vLLM (install one version on every node)")


@functools.cache
def vllm_version() -> str:
    """This process's vLLM (``vllm.__version__``: the same whatever the distribution is named)."""
    import vllm

    return str(vllm.__version__)


def stamp(params: dict[str, Any] | None, version: str | None = None) -> dict[str, Any] | None:
    """A producer's ``kv_transfer_params`` with its vLLM version (None stays None)."""
    if params is None:
        return None
    return {**params, VERSION_KEY: version or vllm_version()}


def refusal(params: dict[str, Any] | None, version: str | None = None) -> VllmVersionMismatch | None:
    """The mismatch when ``params`` came from a producer of another vLLM than ``version`` (this
    process's by default); None when they match or the producer named none."""
    theirs = (params or {}).get(VERSION_KEY)
    if theirs is None:
        return None
    ours = version or vllm_version()
    return None if str(theirs) == ours else VllmVersionMismatch(str(theirs), ours)
