"""Concurrent prefill calls over one conversation: the later one waits for the earlier.

Agent frameworks send their agents' requests over one conversation at once (parallel branches).
vLLM caches a prompt's blocks once they are computed, so two prompts scheduled in the same
engine step both compute the shared part. A prefill replica therefore lets a call whose prompt
shares most of itself with a call already running wait for that call: the shared part is then a
prefix-cache hit and the base computes the conversation once. Within one call nothing waits (a
fan-out computes its shared context first by itself), and a call only ever waits for calls that
started before it, so no cycle can form.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import asynccontextmanager

from app.sharing import common_prefix

WAIT_LIMIT_S = 30.0  # past this a call goes ahead and computes for itself


class PrefixWait:
    """The calls in flight on one replica, with their prompts (cache salt and adapter included:
    only prompts that can hit each other's cache are compared)."""

    def __init__(self, block_size: int, wait_limit_s: float = WAIT_LIMIT_S):
        self.block_size, self.wait_limit_s = block_size, wait_limit_s
        self._running: dict[int, tuple[list[tuple], asyncio.Event]] = {}
        self._next = 0

    def _worth_waiting(self, prompt: tuple, other: tuple) -> bool:
        """At least one full block and half of ``prompt`` would come from ``other``'s cache."""
        if prompt[:2] != other[:2]:  # (salt, adapter) differ: no cache hit possible
            return False
        n = len(common_prefix([prompt[2], other[2]]))
        return n >= self.block_size and 2 * n >= len(prompt[2])

    @asynccontextmanager
    async def turn(self, prompts: Sequence[Sequence[int]], salt: str | None, adapters: Sequence[str | None]):
        """Wait (at most ``wait_limit_s``) for the running calls this call would recompute, then run."""
        mine = [(salt, a, tuple(p)) for p, a in zip(prompts, adapters)]
        earlier = [done for theirs, done in self._running.values()
                   if any(self._worth_waiting(p, q) for p in mine for q in theirs)]
        key, done = self._next, asyncio.Event()
        self._next += 1
        self._running[key] = (mine, done)
        try:
            if earlier:
                await asyncio.wait([asyncio.ensure_future(e.wait()) for e in earlier], timeout=self.wait_limit_s)
            yield len(earlier)
        finally:
            done.set()
            del self._running[key]
