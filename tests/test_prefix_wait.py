"""A prefill call over a conversation another call is computing waits for it; nothing else waits."""
from __future__ import annotations

import asyncio

from deployments.prefix_wait import PrefixWait

CONVERSATION = list(range(100, 164))  # two 32-token blocks


async def _call(wait: PrefixWait, log: list, name: str, prompt, salt=None, adapter=None, hold: float = 0.05):
    async with wait.turn([prompt], salt, [adapter]) as waited:
        log.append((name, "start", waited))
        await asyncio.sleep(hold)
        log.append((name, "end"))


def _run(*calls):
    async def main():
        wait, log = PrefixWait(block_size=32), []
        tasks = []
        for name, prompt, kw in calls:
            tasks.append(asyncio.create_task(_call(wait, log, name, prompt, **kw)))
            await asyncio.sleep(0)  # arrival order = list order
        await asyncio.gather(*tasks)
        assert not wait._running  # every call gave its turn back
        return log
    return asyncio.run(main())


def test_a_second_agent_over_the_same_conversation_starts_after_the_first():
    log = _run(("a", CONVERSATION + [1, 2], {}), ("b", CONVERSATION + [3, 4, 5], {}))
    assert log == [("a", "start", 0), ("a", "end"), ("b", "start", 1), ("b", "end")]


def test_other_conversations_tenants_and_adapters_run_at_once():
    other = list(range(300, 364)) + [1]
    short_share = CONVERSATION[:40] + list(range(500, 600))  # one block shared of a 140-token prompt
    log = _run(("a", CONVERSATION + [1], {}), ("b", other, {}), ("c", CONVERSATION + [2], {"salt": "tenant-2"}),
               ("d", CONVERSATION + [3], {"adapter": "lora"}), ("e", short_share, {}))
    starts = [e for e in log if e[1] == "start"]
    assert [s[0] for s in starts] == ["a", "b", "c", "d", "e"] and all(s[2] == 0 for s in starts)
    assert log.index(("e", "start", 0)) < log.index(("a", "end"))  # all ran at once


def test_a_wait_is_bounded():
    async def main():
        wait = PrefixWait(block_size=32, wait_limit_s=0.05)
        stuck = asyncio.Event()

        async def hog():
            async with wait.turn([CONVERSATION + [1]], None, [None]):
                await stuck.wait()

        hog_task = asyncio.create_task(hog())
        await asyncio.sleep(0)
        async with wait.turn([CONVERSATION + [2]], None, [None]) as waited:
            assert waited == 1  # it waited for the hog, then went ahead on its own
        stuck.set()
        await hog_task
    asyncio.run(main())
