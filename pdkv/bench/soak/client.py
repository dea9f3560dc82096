"""The soak's client: one request through its proxy (streamed or not, cancelled by the client on
time), what came back, and the tally of all of them."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from pdkv.bench.soak.workload import Answer, SoakRequest, request_body

CANCELLED = -1  # Outcome.status of a request the client cancelled before its answer ended
TRANSPORT = 0  # no HTTP answer (refused, reset, timed out)
STREAM_ERROR = 599  # a 200 stream that carried an error event


@dataclass
class Outcome:
    """What one request got.

    Attributes:
        req: the request.
        status: HTTP status, or CANCELLED / TRANSPORT / STREAM_ERROR.
        start, end: time.monotonic() at send and at the end of the answer.
        answer: texts and finish reasons by choice index (None unless status is 200).
        error: an excerpt of the error body or exception.
    """

    req: SoakRequest
    status: int
    start: float
    end: float
    answer: Answer | None = None
    error: str = ""

    @property
    def server_error(self) -> bool:
        """A server-side failure: a 5xx, an error event in a stream, or no answer at all."""
        return self.status >= 500 or self.status == TRANSPORT

    def describe(self, t0: float) -> dict[str, object]:
        """This outcome as one JSON object (what a failed request's line in summary.json says):
        its kind (`request_kind`), n, structured output, planned cancel, status class, the
        error excerpt, and when it was sent and how long it ran (seconds, from `t0`, a
        time.monotonic() value)."""
        r = self.req
        return {"kind": request_kind(r), "item": r.item.key, "n": r.n,
                "structured": r.item.structured or "", "cancel_after_s": r.cancel_after,
                "status": status_class(self.status), "http_status": self.status,
                "error": self.error, "sent_at_s": round(self.start - t0, 3),
                "elapsed_s": round(self.end - self.start, 3)}


async def send(client: httpx.AsyncClient, url: str, model: str, req: SoakRequest,
               timeout: float) -> Outcome:
    """POST `req` to `url` (a proxy's base URL) and read the whole answer, giving up at
    `req.cancel_after` seconds (a client cancel: the connection is closed) or `timeout` seconds
    (a TRANSPORT failure)."""
    body = request_body(req, model)
    path = "/v1/chat/completions" if req.item.api == "chat" else "/v1/completions"
    answer = Answer(req.item.api)

    async def call() -> tuple[int, str]:
        if not req.stream:
            r = await client.post(url + path, json=body)
            if r.status_code != 200:
                return r.status_code, r.text[:300]
            answer.add_response(r.json())
            return 200, ""
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                return r.status_code, (await r.aread()).decode("utf-8", "replace")[:300]
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    answer.add_chunk(json.loads(line[6:]))
        return (STREAM_ERROR, answer.error) if answer.error else (200, "")

    start = time.monotonic()
    limit = timeout if req.cancel_after is None else min(timeout, req.cancel_after)
    try:
        status, error = await asyncio.wait_for(call(), limit)
    except asyncio.TimeoutError:
        status, error = (CANCELLED, "") if req.cancel_after is not None else (
            TRANSPORT, f"no answer in {timeout:.0f} s")
    except httpx.HTTPError as e:
        status, error = TRANSPORT, f"{type(e).__name__}: {e}"
    return Outcome(req, status, start, time.monotonic(), answer if status == 200 else None, error)


@dataclass
class Tally:
    """Counts of the outcomes so far (by status class and by request kind); the sampler reads
    `inflight` and `finished` while the load runs."""

    inflight: int = 0
    finished: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)

    def add(self, o: Outcome) -> None:
        """Count one finished request."""
        self.finished += 1
        self.by_status[status_class(o.status)] += 1
        r = o.req
        self.by_kind[request_kind(r)] += 1
        for tag, on in (("n>1", r.n > 1), ("structured", bool(r.item.structured)),
                        ("cancel planned", r.cancel_after is not None)):
            if on:
                self.by_kind[tag] += 1


def request_kind(r: SoakRequest) -> str:
    """"target/api/stream or whole/greedy or sampled", e.g. "pd/chat/stream/greedy"."""
    return (f"{r.target}/{r.item.api}/{'stream' if r.stream else 'whole'}/"
            f"{'greedy' if r.greedy else 'sampled'}")


def status_class(status: int) -> str:
    """"ok", "cancelled", "4xx", "5xx", "stream_error" or "no_answer"."""
    if status == 200:
        return "ok"
    if status == CANCELLED:
        return "cancelled"
    if status == TRANSPORT:
        return "no_answer"
    if status == STREAM_ERROR:
        return "stream_error"
    return "4xx" if 400 <= status < 500 else "5xx"
