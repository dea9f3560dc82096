"""Token sampling from next-token logits: greedy, temperature, top-k, top-p, min-p, penalties,
logit_bias, min_tokens, structured-output masks, logprobs.

Processing order as in vLLM V1 (vllm/v1/sample/sampler.py): raw logprobs are taken first
(vLLM's default "raw_logprobs"), then logit_bias, the min_tokens mask and the grammar mask
(pdkv.model.structured), then the presence /
frequency / repetition penalties (vllm/model_executor/layers/utils.py `apply_penalties`), then
greedy argmax; random rows continue with temperature, min_p, top-k, top-p, softmax and a draw
from the request's own generator. Every step is a tensor operation over the whole batch; only
the final draw loops over rows (one generator per request). Branches look only at the rows'
host-side params, never at tensor values: `sample_tensors` keeps the ids and the logprob rows
on the device and `SampledTokens.to_host` copies them to the host once per step.
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


@dataclass
class SampledTokens:
    """One step's samples, still on the logits' device (no host copy yet).

    Attributes:
        token_ids: [S] long, the token picked for each row.
        logprobs: [S, 3 + 2 * K] float64 or None (no row asked for logprobs): per row the
            sampled token's (id, logprob, rank), then the K most likely ids, then their
            logprobs (K = the largest `logprobs` any row asked for); ids and ranks are exact in
            float64, logprobs are the float32 values widened.
        num_logprobs: per row the `logprobs` it asked for (None: no entry for that row).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    num_logprobs: list[int | None]

    def to_host(self) -> tuple[list[int], list[list[LogprobEntry]] | None]:
        """(token ids, logprob entries as `sample` returns them) with one device -> host copy
        (one `.tolist()` of the ids and logprob rows together)."""
        if self.logprobs is None:
            return self.token_ids.tolist(), None
        table: list[list[float]] = self.logprobs.tolist()
        k = (self.logprobs.shape[1] - 3) // 2
        tokens = [int(row[0]) for row in table]
        entries: list[list[LogprobEntry]] = []
        for row, num in zip(table, self.num_logprobs):
            if num is None:
                entries.append([])
                continue
            entry = [(int(row[0]), row[1], int(row[2]))]
            entry += [(int(row[3 + j]), row[3 + k + j], j + 1) for j in range(num)]
            entries.append(entry)
        return tokens, entries


def sample(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int], list[list[LogprobEntry]] | None]:
    """Pick one token per row (`sample_tensors` followed by its one host copy).

    Args:
        logits: [S, vocab] float32.
        rows: S SamplingRows, in the same order.

    Returns:
        (token ids [S], per-row [(sampled_id, logprob, rank), (top_1_id, logprob, 1), ...] or
        None when no row asked for logprobs; a row that did not ask has []).
    """
    return sample_tensors(logits, rows).to_host()


def sample_tensors(logits: torch.Tensor, rows: list[SamplingRow]) -> SampledTokens:
    """Pick one token per row, leaving ids and logprobs on the device: no host sync here (every
    branch is on the rows' host-side params), so a GPU step pays one copy, in `to_host`.

    Args:
        logits: [S, vocab] float32.
        rows: S SamplingRows, in the same order.
    """
    want = [r.params.logprobs for r in rows]
    raw_logprobs = (
        torch.log_softmax(logits.float(), dim=-1) if any(n is not None for n in want) else None
    )

    x = process_logits(logits, rows)
    tokens = x.argmax(dim=-1)
    random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_idx:
        rx = _random_logits(x[random_idx], [rows[i].params for i in random_idx])
        probs = rx.softmax(-1)
        for j, i in enumerate(random_idx):
            tokens[i : i + 1] = torch.multinomial(probs[j], 1, generator=rows[i].generator)
    table = (
        None
        if raw_logprobs is None
        else logprob_table(raw_logprobs, tokens, max(n or 0 for n in want))
    )
    return SampledTokens(tokens, table, want)


def logprob_table(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Batched logprob entries: [S, 3 + 2k] float64 rows (token, its logprob, its rank, the k
    most likely ids, their logprobs). logprobs: [S, vocab]; tokens: [S] long. Rank = 1 + the
    number of strictly more likely tokens (vLLM's definition)."""
    lp = logprobs.gather(1, tokens[:, None])  # [S, 1]
    rank = (logprobs > lp).sum(-1, keepdim=True) + 1
    cols = [tokens[:, None].double(), lp.double(), rank.double()]
    if k > 0:
        top = torch.topk(logprobs, k, dim=-1)
        cols += [top.indices.double(), top.values.double()]
    return torch.cat(cols, dim=1)


def logprob_entry(row_logprobs: torch.Tensor, token: int, num: int) -> list[LogprobEntry]:
    """[(token, logprob, rank), then the `num` most likely (id, logprob, 1..num)] of one row.

    row_logprobs: [vocab] log-probabilities; rank = 1 + the number of strictly more likely
    tokens (vLLM's definition). The one-row form of `logprob_table`."""
    ids = torch.tensor([token], device=row_logprobs.device)
    entries = SampledTokens(ids, logprob_table(row_logprobs[None], ids, num), [num]).to_host()[1]
    assert entries is not None
    return entries[0]


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
        x.index_put_(
            (_long(ri, x), _long(ti, x)),
            torch.tensor(vals, dtype=x.dtype, device=x.device),
            accumulate=True,
        )
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
    gather + scatter over the distinct pairs, not R x vocab). The pairs are deduplicated on the
    host, from the token lists it already holds (no device sync, unlike torch.unique)."""
    vocab = x.shape[1]
    dev = x.device
    out_counts: dict[int, float] = {}  # row * vocab + token -> output occurrences (0: prompt only)
    for i, r in enumerate(rows):
        ids = r.token_ids or []
        base = i * vocab
        for t in ids[: r.num_prompt_tokens]:
            out_counts.setdefault(base + t, 0.0)
        for t in ids[r.num_prompt_tokens :]:
            out_counts[base + t] = out_counts.get(base + t, 0.0) + 1.0
    if not out_counts:
        return x
    ukeys = torch.tensor(list(out_counts), dtype=torch.long, device=dev)
    counts = torch.tensor(list(out_counts.values()), dtype=x.dtype, device=dev)
    urows = ukeys // vocab
    rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=x.dtype, device=dev)[
        urows
    ]
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=x.dtype, device=dev)[
        urows
    ]
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
    if any(p.min_p > 0 for p in params):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, neg)
    vocab = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in ks):
        kk = torch.tensor(ks, device=dev)[:, None] - 1
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, kk)
        x = x.masked_fill(x < kth, neg)
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=dev)[:, None]
    if any(p.top_p < 1.0 for p in params):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1.0)
        sorted_x = sorted_x.masked_fill(drop, neg)
        x = torch.full_like(x, neg).scatter(1, order, sorted_x)
    return x


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
