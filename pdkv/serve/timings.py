"""`pdkv_timings`: one engine's own time-to-first-token phases of a request (torch-free).

Every duration is in seconds and comes from this server's monotonic clock (no clock is compared
across processes). The object an engine returns (non-streaming: a top-level `pdkv_timings` field
of the response; streaming: a top-level field of the final chunk, the one with `finish_reason`):

    {"source": "engine", "unit": "s", "total": T,
     "phases": {"input": ..., "queue": ..., "kv_wait": ..., "prefill": ..., "output": ...},
     "tokens": {"prompt": N, "cached": C, "external": E}}

* input: handler start (body parsed) → request created (tokenization, chat template,
  validation);
* queue: request created → first scheduled (for an asynchronous KV load: the load admitted);
* kv_wait: time in WAITING_FOR_REMOTE_KVS (a pull from a prefill engine and/or a KV pool load);
* prefill: first scheduled → first token, minus kv_wait (the engine's own compute of the prompt;
  on a decode engine of P/D, the step that recomputes the last prompt token);
* output: first token → the first chunk carrying text handed to HTTP (streaming), or → the
  response body built (non-streaming: this includes the rest of the generation).

`tokens` says what the phases worked on (counts of prompt tokens): `prompt` in all, `cached` not
computed here (the OpenAI usage's cached_tokens), `external` of those loaded by a KV connector (a
P/D pull, a pool or offload load); `cached - external` hit this engine's own prefix cache (what a
cache-aware router predicts, `pdkv.router.kv_aware`). It is absent when the caller gave no counts.

The phases add up to `total` (handler start → first text chunk / response). A prefill engine's
hold of the blocks until a decode engine reads them happens after its response and is no part
of the time to first token; it is not reported here.
"""

from __future__ import annotations

from typing import TypedDict

from pdkv.outputs import RequestMetrics, RequestOutput

ENGINE_PHASES = ("input", "queue", "kv_wait", "prefill", "output")
"""Phase names of an engine's `pdkv_timings`, in request order."""

_DIGITS = 6  # µs resolution in the JSON


class PromptTokens(TypedDict):
    """The `tokens` of an engine's `pdkv_timings` (module doc): prompt tokens in all, not computed
    here, and of those loaded by a KV connector."""

    prompt: int
    cached: int
    external: int


class _Phases(TypedDict):
    source: str
    unit: str
    total: float
    phases: dict[str, float]


class EngineTimings(_Phases, total=False):
    """An engine's `pdkv_timings` object (module doc): durations in seconds; `tokens` when the
    caller gave the counts."""

    tokens: PromptTokens


def prompt_tokens(out: RequestOutput) -> PromptTokens:
    """The prompt token counts of a finished (or prefilled) request's output."""
    external = out.metrics.num_external_tokens if out.metrics is not None else 0
    return {"prompt": len(out.prompt_token_ids), "cached": max(0, out.num_cached_tokens),
            "external": external}


def engine_timings(received: float, metrics: RequestMetrics | None,
                   out_time: float, tokens: PromptTokens | None = None) -> EngineTimings | None:
    """The engine's `pdkv_timings` object (see the module doc).

    Args:
        received: time.monotonic() when the handler started on the request (s).
        metrics: the request's milestones (monotonic, same clock).
        out_time: time.monotonic() when the first text chunk (streaming) or the response
            (non-streaming) was handed to HTTP (s).
        tokens: the request's prompt token counts (`prompt_tokens`), or None (left out).

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
    timings: EngineTimings = {
        "source": "engine",
        "unit": "s",
        "total": round(out_time - start, _DIGITS),
        "phases": {k: round(v, _DIGITS) for k, v in phases.items()},
    }
    if tokens is not None:
        timings["tokens"] = tokens
    return timings
