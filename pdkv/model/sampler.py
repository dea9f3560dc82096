"""Token sampling from next-token logits: greedy, temperature, top-k, top-p, min-p, penalties,
logit_bias, min_tokens, structured-output masks, logprobs.

Processing order as in vLLM V1 (vllm/v1/sample/sampler.py): raw logprobs are taken first
(vLLM's default "raw_logprobs"), then logit_bias, the min_tokens mask and the grammar mask
(pdkv.model.structured), then the presence /
frequency / repetition penalties (vllm/model_executor/layers/utils.py `apply_penalties`), then
greedy argmax; random rows continue with temperature, min_p, top-k, top-p, softmax and a draw
from the request's own generator. Every step is a tensor operation over the whole batch; only
the final draw loops over rows (one generator per request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdkv.model.structured import apply_grammar_masks
from pdkv.sampling_params import SamplingParams

# One logprobs entry: (token_id, logprob, rank); rank 1 is the most likely token.
LogprobEntry = tuple[int, float, int]


@dataclass
class SamplingRow:
    """What the sampler needs for one logits row.

    Attributes:
        params: the request's sampling params.
        generator: the request's torch.Generator (random rows only).
        mask_token_ids: token ids forbidden now (stop tokens while under min_tokens).
        token_ids: prompt + output so far (read only; needed by the penalties).
        num_prompt_tokens: how many of token_ids are the prompt.
        matcher: the request's llguidance LLMatcher (structured output), else None; the
            sampler only reads its allowed-token mask, the caller advances it.
    """

    params: SamplingParams
    generator: torch.Generator | None
    mask_token_ids: tuple[int, ...]
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    matcher: Any = None


def sample(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int], list[list[LogprobEntry]] | None]:
    """Pick one token per row.

    Args:
        logits: [S, vocab] float32.
        rows: S SamplingRows, in the same order.

    Returns:
        (token ids [S], per-row [(sampled_id, logprob, rank), (top_1_id, logprob, 1), ...] or
        None when no row asked for logprobs; a row that did not ask has []).
    """
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None

    x = process_logits(logits, rows)
    tokens = x.argmax(dim=-1).tolist()
    random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_idx:
        rx = _random_logits(x[random_idx], [rows[i].params for i in random_idx])
        probs = rx.softmax(-1)
        for j, i in enumerate(random_idx):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=rows[i].generator))

    logprobs = None
    if raw_logprobs is not None:
        logprobs = [_logprob_entry(raw_logprobs[i], tokens[i], r.params.logprobs)
                    for i, r in enumerate(rows)]
    return tokens, logprobs


def logprob_entry(row_logprobs: torch.Tensor, token: int, num: int) -> list[LogprobEntry]:
    """[(token, logprob, rank), then the `num` most likely (id, logprob, 1..num)].

    row_logprobs: [vocab] log-probabilities; rank = 1 + the number of strictly more likely
    tokens (vLLM's definition)."""
    lp = row_logprobs[token]
    rank = int((row_logprobs > lp).sum()) + 1
    entry = [(token, float(lp), rank)]
    if num > 0:
        top = torch.topk(row_logprobs, num)
        entry += [(t, v, k + 1) for k, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()))]
    return entry


def _logprob_entry(row_logprobs: torch.Tensor, token: int, num: int | None) -> list[LogprobEntry]:
    return [] if num is None else logprob_entry(row_logprobs, token, num)


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logit_bias, the min_tokens mask, the structured-output grammar masks and the penalties,
    batched; returns float32 [S, vocab] (the input itself when no row needs any of them)."""
    x = logits.float()
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    masked = [(i, r.mask_token_ids) for i, r in enumerate(rows) if r.mask_token_ids]
    penal = [i for i, r in enumerate(rows) if r.params.has_penalties]
    guided = [i for i, r in enumerate(rows) if r.matcher is not None]
    if not (biased or masked or penal or guided):
        return x
    x = x.clone()
    if biased:
        ri, ti, vals = [], [], []
        for i, bias in biased:
            assert bias is not None
            ri += [i] * len(bias)
            ti += list(bias)
            vals += list(bias.values())
        x.index_put_((_long(ri, x), _long(ti, x)), torch.tensor(vals, dtype=x.dtype, device=x.device),
                     accumulate=True)
    if masked:
        ri = [i for i, ids in masked for _ in ids]
        ti = [t for _, ids in masked for t in ids]
        x[_long(ri, x), _long(ti, x)] = float("-inf")
    if guided:
        apply_grammar_masks(x, guided, [rows[i].matcher for i in guided])
    if penal:
        x[penal] = apply_penalties(x[penal], [rows[i] for i in penal])
    return x


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM's apply_penalties on [R, vocab] logits, in place (returns x): repetition over
    prompt + output tokens, then frequency (per output occurrence) and presence (output
    tokens) subtracted.

    Sparse: only the (row, token) pairs present in the histories are read and written (one
    unique + gather + scatter over R x history elements, not R x vocab)."""
    num_rows, vocab = x.shape
    dev = x.device
    row_ids: list[int] = []
    tokens: list[int] = []
    is_out: list[float] = []
    for i, r in enumerate(rows):
        ids = r.token_ids or []
        row_ids += [i] * len(ids)
        tokens += ids
        is_out += [0.0] * r.num_prompt_tokens + [1.0] * (len(ids) - r.num_prompt_tokens)
    if not tokens:
        return x
    keys = torch.tensor(row_ids, dtype=torch.long, device=dev) * vocab + torch.tensor(tokens, dtype=torch.long, device=dev)
    ukeys, inverse = torch.unique(keys, return_inverse=True)
    counts = torch.zeros(len(ukeys), dtype=x.dtype, device=dev).scatter_add_(
        0, inverse, torch.tensor(is_out, dtype=x.dtype, device=dev))
    urows = ukeys // vocab
    rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=x.dtype, device=dev)[urows]
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=x.dtype, device=dev)[urows]
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=x.dtype, device=dev)[urows]
    flat = x.view(-1)  # x is contiguous: process_logits passes a fresh x[rows]
    vals = flat[ukeys]
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    flat[ukeys] = vals - freq * counts - pres * (counts > 0).to(x.dtype)
    return x


def _random_logits(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top-k, top-p over [R, vocab] rows of random requests; dropped
    tokens get -inf."""
    dev, neg = x.device, float("-inf")
    temp = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)[:, None]
    x = x / temp
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev)[:, None]
    if bool((min_p > 0).any()):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, neg)
    vocab = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in ks):
        kk = torch.tensor(ks, device=dev)[:, None] - 1
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, kk)
        x = x.masked_fill(x < kth, neg)
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=dev)[:, None]
    if bool((top_p < 1.0).any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1.0)
        sorted_x = sorted_x.masked_fill(drop, neg)
        x = torch.full_like(x, neg).scatter(1, order, sorted_x)
    return x


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
