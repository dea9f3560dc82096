"""OpenAI response bodies built from engine outputs: their shapes (TypedDicts: full responses,
stream chunks) and pieces: usage, logprobs (completion and chat shapes) and vLLM's
prompt_logprobs. Used by handlers.py for full and streamed responses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypedDict

from pdkv.jsontypes import JSONObject
from pdkv.outputs import Logprob, RequestOutput
from pdkv.serve.timings import EngineTimings

TokenStr = Callable[[int], str]


class PromptTokensDetails(TypedDict):
    """usage.prompt_tokens_details: prompt tokens not computed here, KV bytes loaded by path."""

    cached_tokens: int
    kv_load_bytes: dict[str, int]


class Usage(TypedDict):
    """OpenAI's `usage` (token counts) with pdkv's prompt_tokens_details."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(TypedDict):
    """OpenAI's completion `logprobs` (text_offset in characters)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(TypedDict):
    """One entry of a chat token's `top_logprobs` (bytes: the token's UTF-8 bytes)."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TypedDict):
    """One token of OpenAI's chat `logprobs.content`."""

    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    """OpenAI's chat `logprobs`."""

    content: list[ChatTokenLogprob]


class PromptLogprob(TypedDict):
    """vLLM's prompt_logprobs entry of one token id."""

    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobsJSON = list[dict[str, PromptLogprob] | None]
"""vLLM's prompt_logprobs: per prompt token None (the first) or {token id: entry}."""


class AssistantMessage(TypedDict):
    """A chat choice's `message`."""

    role: str
    content: str


class ChatChoice(TypedDict):
    """One sequence of a chat completion (finish_reason: "stop" | "length" | "abort")."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class CompletionChoice(TypedDict):
    """One sequence of a text completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobsJSON | None


class ChatCompletionResponse(TypedDict):
    """A non-streamed chat completion (`created`: Unix time, s; `pdkv_timings`: the engine's
    phases, pdkv.serve.timings; `kv_transfer_params`: the KV connector's, P/D)."""

    prompt_logprobs: PromptLogprobsJSON | None
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: JSONObject | None
    pdkv_timings: EngineTimings | None


class CompletionResponse(TypedDict):
    """A non-streamed text completion (fields as in ChatCompletionResponse)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kv_transfer_params: JSONObject | None
    pdkv_timings: EngineTimings | None


class Delta(TypedDict, total=False):
    """A streamed chat choice's `delta`: the role in a sequence's first chunk, then text."""

    role: str
    content: str


class _StreamChoiceBase(TypedDict):
    index: int
    finish_reason: str | None


class StreamChoice(_StreamChoiceBase, total=False):
    """One choice of a stream chunk: `delta` (chat) or `text` (completion), `stop_reason` in
    a sequence's last chunk, `prompt_logprobs` in its first one carrying them."""

    delta: Delta
    text: str
    logprobs: ChatLogprobs | CompletionLogprobs | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobsJSON | None


class ChunkHead(TypedDict):
    """What every stream chunk of a request starts with (`created`: Unix time, s)."""

    id: str
    object: str
    created: int
    model: str


class _StreamChunkBase(ChunkHead):
    choices: list[StreamChoice]


class StreamChunk(_StreamChunkBase, total=False):
    """One SSE event's JSON: a sequence's final chunk adds kv_transfer_params and
    pdkv_timings; the usage chunk (stream_options.include_usage) has no choices."""

    usage: Usage
    kv_transfer_params: JSONObject | None
    pdkv_timings: EngineTimings | None


def usage_json(outs: list[RequestOutput]) -> Usage:
    """Usage of one request: the prompt once, the tokens of every sequence (n > 1)."""
    out = outs[0]
    n_prompt, n_out = len(out.prompt_token_ids), sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
        # cached_tokens: OpenAI's; kv_load_bytes (pdkv): bytes of that KV loaded by connectors
        # per path ("p2p": pulled from a prefill engine, "pool": read from the KV pool).
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                  "kv_load_bytes": out.kv_load_bytes},
    }


def completion_logprobs(ids: list[int], lps: Sequence[dict[int, Logprob] | None] | None,
                        token_str: TokenStr) -> CompletionLogprobs | None:
    """OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset in
    characters); a None entry (the first prompt token of an echo) has no logprob."""
    if lps is None:
        return None
    tokens = [token_str(t) for t in ids]
    offsets: list[int] = []
    pos = 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp[t].logprob if lp and t in lp else None for t, lp in zip(ids, lps)],
        "top_logprobs": [None if lp is None else {token_str(k): v.logprob for k, v in lp.items()}
                         for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(ids: list[int], lps: list[dict[int, Logprob]] | None,
                  token_str: TokenStr) -> ChatLogprobs | None:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}, ...]}, the
    top entries by descending logprob."""
    if lps is None:
        return None
    content: list[ChatTokenLogprob] = []
    for t, lp in zip(ids, lps):
        s = token_str(t)
        top = sorted(((k, v.logprob) for k, v in lp.items()), key=lambda kv: -kv[1])
        content.append(
            {
                "token": s,
                "logprob": lp[t].logprob if t in lp else None,
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": (ks := token_str(k)), "logprob": v, "bytes": list(ks.encode())}
                    for k, v in top
                ],
            }
        )
    return {"content": content}


def prompt_logprobs_json(out: RequestOutput) -> PromptLogprobsJSON | None:
    """vLLM's JSON of prompt_logprobs: per prompt token None (the first) or
    {token_id: {"logprob", "rank", "decoded_token"}}."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if d is None
        else {
            str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
            for t, v in d.items()
        }
        for d in out.prompt_logprobs
    ]
