"""Token sampling from next-token logits: greedy, temperature, top-k, top-p, min_tokens, logprobs.

Processing order as in vLLM: min_tokens masking of stop tokens, then (random rows only)
temperature, top-k, top-p, softmax and a draw from the request's own generator. Returned
logprobs are those of the raw model distribution (vLLM's default "raw_logprobs").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdkv.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs for one logits row.

    Attributes:
        params: the request's sampling params.
        generator: the request's torch.Generator (random rows only).
        mask_token_ids: token ids forbidden now (stop tokens while under min_tokens).
    """

    params: SamplingParams
    generator: torch.Generator | None
    mask_token_ids: tuple[int, ...]


def sample(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int], list[list[tuple[int, float]]] | None]:
    """Pick one token per row.

    Args:
        logits: [S, vocab] float32.
        rows: S SamplingRows, in the same order.

    Returns:
        (token ids [S], per-row [(sampled_id, logprob), (top_1_id, logprob), ...] or None when
        no row asked for logprobs).
    """
    num_rows = logits.shape[0]
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    masked = logits
    if any(r.mask_token_ids for r in rows):
        masked = logits.clone()
        for i, r in enumerate(rows):
            if r.mask_token_ids:
                masked[i, list(r.mask_token_ids)] = float("-inf")

    tokens = masked.argmax(dim=-1).tolist()
    for i, r in enumerate(rows):
        if not r.params.greedy:
            tokens[i] = _sample_random(masked[i], r)

    logprobs = None
    if raw_logprobs is not None:
        logprobs = []
        for i in range(num_rows):
            n = rows[i].params.logprobs
            if n is None:
                logprobs.append([])
                continue
            entry = [(tokens[i], float(raw_logprobs[i, tokens[i]]))]
            if n > 0:
                top = torch.topk(raw_logprobs[i], n)
                entry += list(zip(top.indices.tolist(), top.values.tolist()))
            logprobs.append(entry)
    return tokens, logprobs


def _sample_random(logits: torch.Tensor, row: SamplingRow) -> int:
    """Temperature / top-k / top-p draw for one row. logits: [vocab]."""
    p = row.params
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = x.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=row.generator))
