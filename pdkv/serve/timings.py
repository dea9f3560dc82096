"""`pdkv_timings`: one engine's own time-to-first-token phases of a request (torch-free).

Every duration is in seconds and comes from this server's monotonic clock (no clock is compared
across processes). The object an engine returns (non-streaming: a top-level `pdkv_timings` field
of the response; streaming: a top-level field of the final chunk, the one with `finish_reason`):

    {"source": "engine", "unit": "s", "total": T,
     "phases": {"input": ..., "queue": ..., "kv_wait": ..., "prefill": ..., "output": ...}}

* input: handler start (body parsed) → request created (tokenization, chat template,
  validation);
* queue: request created → first scheduled (for an asynchronous KV load: the load admitted);
* kv_wait: time in WAITING_FOR_REMOTE_KVS (a pull from a prefill engine and/or a KV pool load);
* prefill: first scheduled → first token, minus kv_wait (the engine's own compute of the prompt;
  on a decode engine of P/D, the step that recomputes the last prompt token);
* output: first token → the first chunk carrying text handed to HTTP (streaming), or → the
  response body built (non-streaming: this includes the rest of the generation).

The phases add up to `total` (handler start → first text chunk / response). A prefill engine's
hold of the blocks until a decode engine reads them happens after its response and is no part
of the time to first token; it is not reported here.
"""

from __future__ import annotations

from typing import TypedDict

from pdkv.outputs import RequestMetrics

ENGINE_PHASES = ("input", "queue", "kv_wait", "prefill", "output")
"""Phase names of an engine's `pdkv_timings`, in request order."""

_DIGITS = 6  # µs resolution in the JSON


class EngineTimings(TypedDict):
    """An engine's `pdkv_timings` object (module doc): durations in seconds."""

    source: str
    unit: str
    total: float
    phases: dict[str, float]


def engine_timings(received: float, metrics: RequestMetrics | None,
                   out_time: float) -> EngineTimings | None:
    """The engine's `pdkv_timings` object (see the module doc).

    Args:
        received: time.monotonic() when the handler started on the request (s).
        metrics: the request's milestones (monotonic, same clock).
        out_time: time.monotonic() when the first text chunk (streaming) or the response
            (non-streaming) was handed to HTTP (s).

    Returns:
        The object, or None when the request never got a first token (nothing to decompose).
    """
    if metrics is None or metrics.first_token_time is None or metrics.first_scheduled_time is None:
        return None
    arrival = metrics.arrival_time
    start = min(received, arrival)
    kv_wait = metrics.kv_wait_time
    phases = {
        "input": arrival - start,
        "queue": metrics.first_scheduled_time - arrival,
        "kv_wait": kv_wait,
        "prefill": metrics.first_token_time - metrics.first_scheduled_time - kv_wait,
        "output": out_time - metrics.first_token_time,
    }
    return {
        "source": "engine",
        "unit": "s",
        "total": round(out_time - start, _DIGITS),
        "phases": {k: round(v, _DIGITS) for k, v in phases.items()},
    }
