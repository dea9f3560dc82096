"""The proxy's stitched `pdkv_timings`: one request's time to first token, phase by phase.

The proxy times its own work and each leg with its monotonic clock, reads each engine's
`pdkv_timings` (pdkv.serve.timings: durations from that engine's clock, so no clocks are
compared across processes) and returns one object in place of the decode engine's (non-streaming:
the response's top-level `pdkv_timings`; streaming: the final chunk's):

    {"source": "proxy", "unit": "s", "mode": "pd" | "pd_skip_prefill" | "pd_push" | "colocated",
     "total": T, "phases": {...}, "proxy_parts": {...},
     "legs": {"prefill": {engine's}, "decode": {engine's}}}

`total` is what the proxy saw: request received → first chunk carrying text relayed
(streaming), or → the decode leg's response received (non-streaming). The phases add up to it:

P/D ("pd"), in request order:
    proxy          received → prefill leg sent (parse, validate, route, length check)
    p_input, p_queue, p_kv_wait, p_prefill, p_output    the prefill engine's own phases
    p_residual     prefill leg wall time − the prefill engine's total (HTTP both ways, JSON)
    proxy_between  prefill leg answered → decode leg sent
    d_input, d_queue                                    the decode engine's own phases
    transfer       the decode engine's KV wait (pull from P and/or pool load)
    d_first_step   the decode engine's prefill phase (the step that recomputes the last prompt
                   token; more when it computes part of the prompt itself)
    d_output       the decode engine's first token → first text chunk handed to HTTP
    d_residual     decode leg sent → first text chunk relayed, minus the decode engine's total

`proxy_parts` splits the `proxy` phase by the proxy's steps before the first leg (they add up to
it): `body` (read, parse and validate the body), `models` (the unknown-model check, with a
refetch of stale engine info), `route` (health, routing policy), `length` (the layout check and
the prompt-length check: D's POST /tokenize when the prompt's size cannot rule out a refusal),
`other` (the rest, e.g. the pool record). Each part is wall time on the proxy's event loop, so it
also holds the time this request waited while the loop ran other requests.

"pd_skip_prefill" (the pool held the prompt, no prefill leg) has the same phases without the
p_* ones and proxy_between. "pd_push" (the push flow, `pdkv.router.proxy_push`: the decode leg
goes first and P writes into D's blocks while D waits) has the same phases as "pd_skip_prefill":
D's `transfer` holds the wait for D's window, P's whole leg and the layers still landing after
it; P's own object is under legs.prefill for reference (its phases overlap D's wait).
"colocated" (`--backends`): proxy, input, queue, kv_wait, prefill, output, residual. A backend
that returns no `pdkv_timings` (another server) contributes zeros, and its whole leg lands in
p_residual / d_residual / residual.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TypedDict

from pdkv.jsontypes import JSONValue
from pdkv.serve.timings import ENGINE_PHASES

_DIGITS = 6
_P_MAP = {"input": "p_input", "queue": "p_queue", "kv_wait": "p_kv_wait", "prefill": "p_prefill",
          "output": "p_output"}
_D_MAP = {"input": "d_input", "queue": "d_queue", "kv_wait": "transfer", "prefill": "d_first_step",
          "output": "d_output"}
_WHOLE_MAP = {name: name for name in ENGINE_PHASES}

PD_PHASES = (
    "proxy",
    *_P_MAP.values(),
    "p_residual",
    "proxy_between",
    *_D_MAP.values(),
    "d_residual",
)
"""Phase names of a stitched P/D `pdkv_timings`, in request order."""
PROXY_PARTS = ("body", "models", "route", "length", "other")
"""Names of the parts of the `proxy` phase (`proxy_parts`), in order."""
COLOCATED_PHASES = ("proxy", *ENGINE_PHASES, "residual")
"""Phase names of a stitched colocated `pdkv_timings`, in request order."""


class StitchedTimings(TypedDict):
    """The proxy's `pdkv_timings` (module doc): durations in seconds; `legs`: each engine's
    object as it sent it, by leg ("prefill", "decode" or "whole")."""

    source: str
    unit: str
    mode: str
    total: float
    phases: dict[str, float]
    proxy_parts: dict[str, float]
    legs: dict[str, JSONValue]


def _engine_phases(timings: JSONValue) -> tuple[dict[str, float], float]:
    """(phases, total) of an engine's `pdkv_timings`; zeros when absent or malformed."""
    if not isinstance(timings, dict) or not isinstance(raw := timings.get("phases"), dict):
        return {}, 0.0
    phases = {k: float(v) for k, v in raw.items()
              if k in ENGINE_PHASES and isinstance(v, (int, float))}
    total = timings.get("total")
    return phases, float(total) if isinstance(total, (int, float)) else sum(phases.values())


@dataclass
class RequestClock:
    """The proxy's timestamps of one request (time.monotonic(), seconds).

    Attributes:
        received: the proxy started on the request.
        mode: "pd", "pd_skip_prefill", "pd_push" or "colocated".
        p_sent, p_done: the prefill leg sent / its response read (P/D only).
        p_timings: the prefill engine's `pdkv_timings` (None when it sent none).
        d_sent: the decode leg (or the whole request) sent.
        d_first: the first chunk carrying text seen (streaming) or the response read.
        marks: when each part of the `proxy` phase ended (PROXY_PARTS but "other"), as noted.
        d_timings: the decode engine's (or colocated instance's) own `pdkv_timings`, once
            `stitch` has read it (None before, or when it sent none).
    """

    received: float = field(default_factory=time.monotonic)
    mode: str = "pd"
    p_sent: float | None = None
    p_done: float | None = None
    p_timings: JSONValue = None
    d_sent: float | None = None
    d_first: float | None = None
    marks: dict[str, float] = field(default_factory=dict)
    d_timings: JSONValue = None

    def mark(self, part: str) -> None:
        """Note that the proxy's step `part` (one of PROXY_PARTS but "other") ended now.

        Raises:
            ValueError: an unknown part.
        """
        if part not in PROXY_PARTS or part == "other":
            raise ValueError(f"unknown proxy part {part!r}")
        self.marks[part] = time.monotonic()

    def _proxy_parts(self, first_leg_sent: float) -> dict[str, float]:
        """The parts of the `proxy` phase (seconds; a part not marked is 0, `other` the rest up to
        `first_leg_sent`)."""
        parts: dict[str, float] = {}
        last = self.received
        for name in PROXY_PARTS[:-1]:
            at = self.marks.get(name)
            parts[name] = 0.0 if at is None else max(0.0, at - last)
            last = last if at is None else max(last, at)
        parts["other"] = first_leg_sent - last
        return parts

    def stitch(self, d_timings: JSONValue) -> StitchedTimings:
        """The combined `pdkv_timings` (module doc) given the decode engine's object.

        Raises:
            ValueError: the decode leg's send or first-text times are not set.
        """
        if self.d_sent is None or self.d_first is None:
            raise ValueError("the decode leg's times are not recorded")
        self.d_timings = d_timings
        d_phases, d_total = _engine_phases(d_timings)
        phases: dict[str, float] = {}
        legs: dict[str, JSONValue] = {}
        if self.mode == "colocated":
            phases["proxy"] = self.d_sent - self.received
            phases.update({_WHOLE_MAP[k]: d_phases.get(k, 0.0) for k in ENGINE_PHASES})
            phases["residual"] = (self.d_first - self.d_sent) - d_total
            legs["whole"] = d_timings
        else:
            if self.mode == "pd":
                if self.p_sent is None or self.p_done is None:
                    raise ValueError("the prefill leg's times are not recorded")
                p_phases, p_total = _engine_phases(self.p_timings)
                phases["proxy"] = self.p_sent - self.received
                phases.update({_P_MAP[k]: p_phases.get(k, 0.0) for k in ENGINE_PHASES})
                phases["p_residual"] = (self.p_done - self.p_sent) - p_total
                phases["proxy_between"] = self.d_sent - self.p_done
                legs["prefill"] = self.p_timings
            else:
                phases["proxy"] = self.d_sent - self.received
                if self.mode == "pd_push":
                    legs["prefill"] = self.p_timings
            phases.update({_D_MAP[k]: d_phases.get(k, 0.0) for k in ENGINE_PHASES})
            phases["d_residual"] = (self.d_first - self.d_sent) - d_total
            legs["decode"] = d_timings
        return {
            "source": "proxy",
            "unit": "s",
            "mode": self.mode,
            "total": round(self.d_first - self.received, _DIGITS),
            "phases": {k: round(v, _DIGITS) for k, v in phases.items()},
            "proxy_parts": {k: round(v, _DIGITS) for k, v in
                            self._proxy_parts(self.received + phases["proxy"]).items()},
            "legs": legs,
        }


def _has_text(data: JSONValue) -> bool:
    """Whether a parsed completion chunk / response carries output text."""
    if not isinstance(data, dict):
        return False
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    c = choices[0]
    delta, message = c.get("delta"), c.get("message")
    delta = delta if isinstance(delta, dict) else {}
    message = message if isinstance(message, dict) else {}
    return bool(c.get("text") or delta.get("content") or message.get("content"))


def stitch_response(clock: RequestClock, content: bytes) -> bytes:
    """A non-streamed response body with its `pdkv_timings` replaced by the stitched one
    (`clock.d_first` set to now when unset); the body unchanged when it is not a JSON object."""
    if clock.d_first is None:
        clock.d_first = time.monotonic()
    try:
        data = json.loads(content)
    except ValueError:
        return content
    if not isinstance(data, dict):
        return content
    data["pdkv_timings"] = clock.stitch(data.get("pdkv_timings"))
    return json.dumps(data).encode()


class StreamStitcher:
    """Relays an SSE stream event by event: notes when the first event carrying text passes
    (`clock.d_first`) and replaces the `pdkv_timings` of the event that carries one (the final
    chunk) by the stitched object. Other events pass unchanged; JSON is parsed only until the
    first text and for the event carrying `pdkv_timings`."""

    def __init__(self, clock: RequestClock) -> None:
        self.clock = clock
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to relay now: every complete event (ending in a blank line) of the data so far."""
        self._buf += chunk
        out: list[bytes] = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            event, self._buf = self._buf[: end + 2], self._buf[end + 2:]
            out.append(self._event(event))
        return b"".join(out)

    def flush(self) -> bytes:
        """What is left at the end of the stream (an unterminated event, unchanged)."""
        rest, self._buf = self._buf, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        first_pending = self.clock.d_first is None
        has_timings = b'"pdkv_timings"' in event
        if not (first_pending or has_timings) or not event.startswith(b"data:"):
            return event
        body = event[len(b"data:"):].strip()
        if body == b"[DONE]":
            return event
        try:
            data = json.loads(body)
        except ValueError:
            return event
        if first_pending and _has_text(data):
            self.clock.d_first = time.monotonic()
        if has_timings and isinstance(data, dict) and self.clock.d_first is not None:
            data["pdkv_timings"] = self.clock.stitch(data.get("pdkv_timings"))
            return f"data: {json.dumps(data)}\n\n".encode()
        return event
