"""The chaos run's client side: a seeded request plan, requests with client cancels, and the
tally of what came back (which 5xx fall inside the restart window)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from pdkv.keepalive import client_limits

WORDS = (
    "river",
    "stone",
    "cloud",
    "light",
    "garden",
    "music",
    "paper",
    "window",
    "silver",
    "forest",
    "engine",
    "winter",
    "market",
    "letter",
    "bridge",
    "candle",
    "ocean",
    "thunder",
    "harbor",
    "lantern",
    "meadow",
    "copper",
    "violin",
    "tower",
)

CANCELLED = -1  # Outcome.status of a request the client cancelled
TRANSPORT = 0  # Outcome.status when no HTTP answer came (refused, reset, timeout)


@dataclass(frozen=True)
class Planned:
    """One request of the plan.

    Attributes:
        prompt: completion prompt text.
        max_tokens: output budget.
        stream: streamed or not.
        cancel_after: seconds after sending at which the client gives up (None: never).
    """

    prompt: str
    max_tokens: int
    stream: bool
    cancel_after: float | None


def make_plan(n: int, seed: int, cancel_fraction: float, prefill_s: float, window_s: float,
              max_tokens: int) -> list[Planned]:
    """`n` requests from `seed`: prompts of 8-60 words, 1..max_tokens outputs, half streamed, and
    `cancel_fraction` of them cancelled at prefill_s + uniform(-window_s/2, +window_s/2) seconds."""
    rng = random.Random(seed)
    plan = []
    for _ in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
        cancel = None
        if rng.random() < cancel_fraction:
            cancel = max(0.001, prefill_s + rng.uniform(-window_s / 2, window_s / 2))
        plan.append(Planned(prompt, rng.randint(1, max_tokens), rng.random() < 0.5, cancel))
    return plan


@dataclass
class Outcome:
    """What one request got: HTTP status (CANCELLED / TRANSPORT otherwise), send/finish times
    (time.monotonic()) and an error excerpt."""

    status: int
    start: float
    end: float
    error: str = ""

    @property
    def failed(self) -> bool:
        """A server-side failure: 5xx, an error event in a stream, or no answer at all."""
        return self.status >= 500 or self.status == TRANSPORT


async def send_one(client: httpx.AsyncClient, endpoint: str, model: str, item: Planned,
                   timeout: float) -> Outcome:
    """Send `item` and wait for the whole answer (or cancel it on time). A stream that carries
    an error event counts as a 502."""
    body = {"model": model, "prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0,
            "stream": item.stream}
    url = endpoint + "/v1/completions"

    async def call() -> tuple[int, str]:
        if not item.stream:
            r = await client.post(url, json=body)
            return r.status_code, "" if r.status_code == 200 else r.text[:300]
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return r.status_code, (await r.aread()).decode("utf-8", "replace")[:300]
            async for line in r.aiter_lines():
                if line.startswith("data: {") and "error" in json.loads(line[6:]):
                    return 502, line[:300]
        return 200, ""

    start = time.monotonic()
    limit = timeout if item.cancel_after is None else min(timeout, item.cancel_after)
    try:
        status, error = await asyncio.wait_for(call(), limit)
    except asyncio.TimeoutError:
        status, error = (
            (CANCELLED, "") if item.cancel_after is not None else (TRANSPORT, "timed out")
        )
    except httpx.HTTPError as e:
        status, error = TRANSPORT, f"{type(e).__name__}: {e}"
    return Outcome(status, start, time.monotonic(), error)


@dataclass
class LoadResult:
    """Every outcome, the restart window (monotonic times; 0 when no restart happened) and the
    first request after the restart."""

    outcomes: list[Outcome] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    first_after_restart: Outcome | None = None

    def in_window(self, o: Outcome) -> bool:
        """Whether `o` was in flight at some point of the restart window."""
        lo, hi = self.window
        return o.start <= hi and o.end >= lo

    def counts(self) -> dict[str, int]:
        """The tally the run prints (and checks)."""
        out = self.outcomes
        failed = [o for o in out if o.failed]
        return {
            "requests": len(out),
            "ok": sum(o.status == 200 for o in out),
            "cancelled": sum(o.status == CANCELLED for o in out),
            "client_errors_4xx": sum(400 <= o.status < 500 for o in out),
            "failed_in_restart_window": sum(self.in_window(o) for o in failed),
            "failed_outside_restart_window": sum(not self.in_window(o) for o in failed),
        }


async def run_load(
    endpoint: str,
    model: str,
    plan: list[Planned],
    concurrency: int,
    restart_at: int,
    restart: Callable[[], Awaitable[tuple[float, float]]],
    first: Planned,
    timeout: float,
) -> LoadResult:
    """Send `plan` with `concurrency` workers. When request `restart_at` is due, new requests
    pause (those in flight go on) while `restart()` runs (it returns the window: kill time and
    healthy-again time); then `first` is sent alone and the plan resumes."""
    result = LoadResult()
    running = asyncio.Event()
    running.set()
    next_index = iter(range(len(plan)))
    limits = client_limits(concurrency + 4)  # drops idle connections before the server does

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=5.0), limits=limits
    ) as client:

        async def worker() -> None:
            for i in next_index:
                if i == restart_at:
                    running.clear()
                    result.window = await restart()
                    result.first_after_restart = await send_one(
                        client, endpoint, model, first, timeout
                    )
                    running.set()
                await asyncio.wait_for(running.wait(), timeout)
                result.outcomes.append(await send_one(client, endpoint, model, plan[i], timeout))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result
