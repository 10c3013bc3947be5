"""asyncio helpers for serving one ``/generate`` batch as several engine requests.

Used by the vLLM plugin (engine generators) and the sidecar (upstream HTTP calls): run every
prompt at once, cancel the rest when one fails, merge live streams, and prime a stream so that
failures before its first event still get a real HTTP status.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Sequence
from typing import TypeVar

__all__ = ["gather_or_cancel", "merge_streams", "primed"]

T = TypeVar("T")


async def gather_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await all, in order; if one fails (or we are cancelled), cancel the others and re-raise.

    Cancelling a vLLM generator aborts its request in the engine; cancelling an httpx call closes it.
    """
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield ``(stream index, item)`` as items arrive from any stream; the first error is raised here.

    Every stream is drained by its own task; on exit (done, error, or the consumer closing us)
    the tasks are cancelled and every stream is closed.
    """
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for item in streams[i]:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer below
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            aclose = getattr(s, "aclose", None)
            if aclose is not None:
                await aclose()


async def primed(agen: AsyncIterator[T]) -> AsyncIterator[T]:
    """Pull the first item now (errors raise here, before any HTTP status is sent); return the whole stream."""
    first = await agen.__anext__()

    async def rest() -> AsyncIterator[T]:
        try:
            yield first
            async for item in agen:
                yield item
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                await aclose()

    return rest()
