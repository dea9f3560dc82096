"""Pieces of OpenAI response bodies built from engine outputs: usage, logprobs (completion and
chat shapes) and vLLM's prompt_logprobs. Used by handlers.py for full and streamed responses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdkv.outputs import Logprob, RequestOutput

TokenStr = Callable[[int], str]


def usage_json(outs: list[RequestOutput]) -> dict[str, Any]:
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
                        token_str: TokenStr) -> dict[str, Any] | None:
    """OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset in
    characters); a None entry (the first prompt token of an echo) has no logprob."""
    if lps is None:
        return None
    tokens = [token_str(t) for t in ids]
    offsets, pos = [], 0
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
                  token_str: TokenStr) -> dict[str, Any] | None:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}, ...]}, the
    top entries by descending logprob."""
    if lps is None:
        return None
    content = []
    for t, lp in zip(ids, lps):
        s = token_str(t)
        top = sorted(((k, v.logprob) for k, v in lp.items()), key=lambda kv: -kv[1])
        content.append({
            "token": s,
            "logprob": lp[t].logprob if t in lp else None,
            "bytes": list(s.encode()),
            "top_logprobs": [{"token": (ks := token_str(k)), "logprob": v, "bytes": list(ks.encode())}
                             for k, v in top],
        })
    return {"content": content}


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's JSON of prompt_logprobs: per prompt token None (the first) or
    {token_id: {"logprob", "rank", "decoded_token"}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if d is None else {str(t): {"logprob": v.logprob, "rank": v.rank,
                                             "decoded_token": v.decoded_token} for t, v in d.items()}
            for d in out.prompt_logprobs]
