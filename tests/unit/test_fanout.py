"""rr_server.serving.fanout: one /generate batch as several engine requests (cancel on failure, merged live streams)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rr_server.serving.fanout import gather_or_cancel, merge_streams, primed


async def test_gather_or_cancel_returns_in_order() -> None:
    async def value(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    assert await gather_or_cancel([value(1, 0.03), value(2, 0.0), value(3, 0.01)]) == [1, 2, 3]


async def slow(i: int, cancelled: list[int], finished: list[int]) -> int:
    """Sleeps 30 s unless cancelled; records which it was in ``cancelled`` or ``finished``."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        cancelled.append(i)
        raise
    finished.append(i)
    return i


async def test_gather_or_cancel_cancels_siblings_on_failure() -> None:
    cancelled: list[int] = []
    finished: list[int] = []

    async def boom() -> int:
        await asyncio.sleep(0.01)
        raise RuntimeError("engine rejected prompt 1")

    with pytest.raises(RuntimeError, match="engine rejected prompt 1"):
        await gather_or_cancel([slow(0, cancelled, finished), boom(), slow(2, cancelled, finished)])
    assert sorted(cancelled) == [0, 2] and not finished  # cancelled, not waited for (no wall-clock bound needed)


async def test_gather_or_cancel_cancelled_from_outside_cancels_all() -> None:
    cancelled: list[int] = []
    finished: list[int] = []

    task = asyncio.ensure_future(gather_or_cancel([slow(0, cancelled, finished), slow(1, cancelled, finished)]))
    await asyncio.sleep(0.01)
    task.cancel()  # what a client disconnect does to the batch
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == [0, 1] and not finished


class Stream:
    """An async generator-like stream that yields after given delays and records being closed."""

    def __init__(self, items: list[tuple[float, object]], fail: Exception | None = None) -> None:
        self.items, self.fail, self.closed = items, fail, False
        self._gen = self._run()

    async def _run(self) -> AsyncIterator[object]:
        try:
            for delay, item in self.items:
                await asyncio.sleep(delay)
                yield item
            if self.fail is not None:
                raise self.fail
            await asyncio.sleep(0)
        finally:
            self.closed = True

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> object:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()
        self.closed = True


async def test_merge_streams_interleaves_as_items_arrive() -> None:
    a = Stream([(0.00, "a0"), (0.10, "a1"), (0.10, "a2")])
    b = Stream([(0.05, "b0"), (0.10, "b1")])
    got = [x async for x in merge_streams([a, b])]
    assert got == [(0, "a0"), (1, "b0"), (0, "a1"), (1, "b1"), (0, "a2")]
    assert a.closed and b.closed


async def test_merge_streams_propagates_an_error_and_closes_every_stream() -> None:
    ok = Stream([(0.0, "x0"), (5.0, "never")])
    bad = Stream([(0.01, "y0")], fail=ValueError("upstream stream failed"))
    got: list[tuple[int, object]] = []
    with pytest.raises(ValueError, match="upstream stream failed"):
        async for item in merge_streams([ok, bad]):
            got.append(item)
    assert got == [(0, "x0"), (1, "y0")]
    assert ok.closed and bad.closed  # the slow sibling was not left running


async def test_primed_raises_before_the_first_item_then_yields_all() -> None:
    async def failing() -> AsyncIterator[int]:
        raise LookupError("admission failed")
        yield 0  # pragma: no cover

    with pytest.raises(LookupError, match="admission failed"):
        await primed(failing())

    async def three() -> AsyncIterator[int]:
        for i in range(3):
            yield i

    assert [x async for x in await primed(three())] == [0, 1, 2]
