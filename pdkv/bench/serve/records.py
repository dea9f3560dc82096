"""Plain records shared by the dataset, client and metrics modules of `pdkv bench serve`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdkv.jsontypes import JSONObject


@dataclass
class SampleRequest:
    """One benchmark prompt.

    Attributes:
        prompt: the prompt text (sent as `prompt` to completions, as the user message to chat).
        prompt_len: prompt length in tokens as measured client-side (server `/tokenize` or the
            word fallback); the server's `usage.prompt_tokens` replaces it when reported.
        output_len: requested output tokens (`max_tokens`).
        messages: the chat messages when the sample is a conversation (multi-turn): sent as
            `messages` to chat instead of one user message; `prompt` is their transcript, sent to
            completions.
    """

    prompt: str
    prompt_len: int
    output_len: int
    messages: list[dict[str, str]] | None = None


@dataclass
class RequestResult:
    """What one streamed request measured (times in seconds, lengths in tokens).

    Definitions follow vLLM's `benchmarks/lib/endpoint_request_func.py`, except that only
    chunks carrying text count as tokens (a role-only or empty-text chunk does not):

    * `ttft`: from sending the request to the first content-carrying chunk;
    * `itl`: gaps between consecutive content-carrying chunks (a chunk carrying several tokens
      contributes one gap);
    * `latency` (E2EL): from sending the request to the end of the stream (`data: [DONE]`, or
      the last event if the server closes without it);
    * `output_tokens`: `usage.completion_tokens` of the final usage chunk; when the server sends
      no usage it falls back to the number of content chunks and `usage_missing` is set;
    * `prompt_tokens`: `usage.prompt_tokens`, else the client-side `prompt_len`;
    * `pdkv_timings`: the server's TTFT phases (a pdkv engine's or proxy's `pdkv_timings`, read
      from the chunk that carries it), None when the server sends none.
    """

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    prompt_len: int = 0
    usage_missing: bool = False
    num_content_chunks: int = 0
    generated_text: str = ""
    start_time: float = 0.0
    queue_time: float = 0.0
    pdkv_timings: JSONObject | None = None
