"""n > 1 for the OpenAI server: one engine request per sequence, their outputs merged.

The sequences are separate engine requests (ids `<id>-<i>`, SamplingParams.child(i)); the
prompt's full blocks are shared between them through the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pdkv.outputs import RequestOutput

_DONE = object()


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (sequence index, output) from every stream as they come, until all finished.

    An error in any stream is raised here; leaving early (or an error) cancels the other
    streams, which aborts their engine requests.
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            close = getattr(streams[0], "aclose", None)
            if close is not None:
                await close()  # leaving early aborts the engine request now
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, _DONE))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                assert isinstance(item, RequestOutput)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
