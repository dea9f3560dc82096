"""Outputs returned to users, with vLLM's names (`RequestOutput`, `CompletionOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdkv.jsontypes import JSONObject


@dataclass
class Logprob:
    """One token's log-probability, as vLLM's `Logprob`.

    Attributes:
        logprob: natural-log probability under the raw model distribution.
        rank: 1 + the number of tokens more likely than this one.
        decoded_token: the token's text (special tokens kept).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: position among the request's sequences (0 .. n-1).
        text: generated text so far (stop string excluded).
        token_ids: generated token ids so far.
        finish_reason: None while running, then "stop" | "length" | "abort" | "error".
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: per token, {token_id: Logprob} (sampled token + top-N), or None.
        cumulative_logprob: sum of sampled tokens' logprobs when logprobs were requested.
        delta_text / delta_token_ids: what this step added (for streaming).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Milestones of a request: time.monotonic() timestamps; every derived value (ttft,
    queue_time, prefill_time, tpot, e2el) and kv_wait_time are in seconds."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    num_output_tokens: int = 0
    kv_wait_time: float = 0.0
    """Seconds spent waiting for an asynchronous KV load (WAITING_FOR_REMOTE_KVS: a pull from a
    prefill engine and/or a pool load); 0 when none."""
    num_external_tokens: int = 0
    """Prompt tokens whose KV a KV connector loaded (P/D pull, KV pool, host offload) instead of
    this engine computing them; part of RequestOutput.num_cached_tokens (the rest are local
    prefix-cache hits)."""
    max_tokens_param: int | None = None
    """The request's max_tokens sampling parameter (tokens)."""

    @property
    def ttft(self) -> float | None:
        """Time to first token (s)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduling (s)."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduling to first token, minus the KV wait (s): the engine's own compute of
        the prompt (steps it was scheduled in, and waits between them)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return max(0.0, self.first_token_time - self.first_scheduled_time - self.kv_wait_time)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (s): (last - first) / (n - 1)."""
        n = self.num_output_tokens
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)

    @property
    def e2el(self) -> float | None:
        """End-to-end latency (s)."""
        end = self.finished_time or self.last_token_time
        return None if end is None else end - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    Attributes:
        request_id: id.
        prompt: prompt text (None when given as token ids).
        prompt_token_ids: prompt tokens.
        outputs: one CompletionOutput per sequence (n of them).
        prompt_logprobs: per prompt token, {token_id: Logprob} (None for the first token), when
            prompt_logprobs was asked; else None.
        finished: True once the request ended.
        num_cached_tokens: prompt tokens served from the prefix cache (or a KV connector).
        kv_load_bytes: bytes of the prompt's KV loaded by KV connectors, by path ("p2p":
            pulled from a prefill engine, "pool": read from the KV pool); empty when none.
        metrics: timestamps.
        kv_transfer_params: what the KV connector returns to the client (P/D), else None.
        error: why the request failed (finish_reason "error"), else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    kv_load_bytes: dict[str, int] = field(default_factory=dict)
    metrics: RequestMetrics | None = None
    kv_transfer_params: JSONObject | None = None
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
