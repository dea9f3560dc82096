"""Race a request's work against the client disconnecting (shared by the server and the proxy)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the work finished (the work was cancelled)."""


async def until_done_or_disconnect(work: Awaitable[T], raw: Request) -> T:
    """Await `work`; if the client disconnects first, cancel it (cancellation aborts whatever the
    work started, e.g. the engine request or the backend legs) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise ClientDisconnected()
    return task.result()
