"""Paged-attention metadata of one step, built from the scheduled requests' block tables.

The model runner flattens the step's requests into one token batch and hands each request's
(flat start, query count n, cached tokens c, block table) here; this module turns them into the
slot mapping and block tables that `pdkv.model.attention.paged_attention` reads. With decode
context parallelism the rank's shard metadata comes from `pdkv.model.dcp_attention` instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pdkv.model.attention import AttentionMetadata, PrefillSeq
from pdkv.model.gated_delta import LinearStateMetadata, decode_runs
from pdkv.model.v4_attention import V4StepMetadata, V4StepRequest

if TYPE_CHECKING:
    from pdkv.cache.specs import KVCacheGroupSpec
    from pdkv.parallel.context import ParallelContext

# (flat start, query tokens n, cached tokens c, block table): queries are positions c .. c+n-1.
StepRequest = tuple[int, int, int, list[int]]


def build_attention_metadata(
    requests: Sequence[StepRequest], num_tokens: int, block_size: int, device: torch.device,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Slots, prefill runs and decode tables of one step over one block table per request (the
    tables of one KV cache group).

    Args:
        requests: per scheduled request, in flat-batch order (see StepRequest).
        num_tokens: T, the step's flat token count (sum of the n).
        block_size: tokens per block.
        sliding_window: the group's window W in tokens (None: full attention). Decode rows then
            start at the block of key max(0, len - W) and their mask also bounds keys from below
            (the query at p sees p - W < k <= p).

    Returns:
        the step's AttentionMetadata (requests with n == 1 are decodes, the others prefill runs).
    """
    bs = block_size
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    prefills: list[PrefillSeq] = []
    dec_idx: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    dec_first: list[int] = []  # first key position of each decode row's table
    pre_tables: list[list[int]] = []
    for start, n, c, table in requests:
        rng = range(c, c + n)
        slot_blocks.extend(table[p // bs] for p in rng)
        slot_offsets.extend(p % bs for p in rng)
        if n == 1:
            dec_idx.append(start)
            first = 0 if sliding_window is None else max(0, c + 1 - sliding_window) // bs
            dec_tables.append(table[first : c // bs + 1])
            dec_lens.append(c + 1)
            dec_first.append(first * bs)
        else:
            nblocks = -(-(c + n) // bs)
            pre_tables.append(table[:nblocks])
            prefills.append(
                PrefillSeq(start, start + n, c, torch.tensor(table[:nblocks], device=device))
            )
    decode_token_idx = decode_tables = decode_lens = decode_mask = key_blocks = key_offsets = None
    if dec_idx:
        width = max(len(t) for t in dec_tables)
        padded = [t + [0] * (width - len(t)) for t in dec_tables]
        decode_token_idx = torch.tensor(dec_idx, device=device)
        decode_tables = torch.tensor(padded, device=device)
        decode_lens = torch.tensor(dec_lens, device=device)
        if len(dec_idx) > 1:
            keys = torch.arange(width * bs, device=device)
            if sliding_window is None:
                decode_mask = (keys[None, :] < decode_lens[:, None])[:, None, None, :]
            else:  # key j of row i is position first_i + j
                rel = decode_lens - torch.tensor(dec_first, device=device)
                visible = (keys[None, :] < rel[:, None]) & (
                    keys[None, :] >= rel[:, None] - sliding_window
                )
                decode_mask = visible[:, None, None, :]
            key_blocks, key_offsets = _decode_key_slots(
                decode_tables, decode_mask[:, 0, 0], dec_lens, dec_first, bs
            )
    return AttentionMetadata(
        slot_block_ids=torch.tensor(slot_blocks, dtype=torch.long, device=device),
        slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
        prefills=prefills,
        **_prefill_batch_fields(prefills, pre_tables, device),
        decode_token_idx=decode_token_idx,
        decode_block_tables=decode_tables,
        decode_seq_lens=decode_lens,
        decode_mask=decode_mask,
        decode_key_blocks=key_blocks,
        decode_key_offsets=key_offsets,
        all_decode=len(dec_idx) == num_tokens,
        sliding_window=sliding_window,
        decode_seq_lens_cpu=tuple(dec_lens),
    )


def _prefill_batch_fields(prefills: list[PrefillSeq], tables: list[list[int]],
                          device: torch.device) -> dict[str, Any]:
    """The prefill_* fields of AttentionMetadata (see there): all runs of the step as one
    varlen batch for the batched prefill op, built once per step (empty dict without runs)."""
    if not prefills:
        return {}
    lens = [seq.end - seq.start for seq in prefills]
    width = max(len(t) for t in tables)
    contiguous = all(a.end == b.start for a, b in zip(prefills, prefills[1:]))
    token_idx = None if contiguous else torch.cat(
        [torch.arange(seq.start, seq.end, device=device) for seq in prefills])
    return {
        "prefill_cu_seqlens": torch.tensor(
            [0, *itertools.accumulate(lens)], dtype=torch.long, device=device
        ),
        "prefill_context_lens": torch.tensor(
            [seq.context_len for seq in prefills], dtype=torch.long, device=device
        ),
        "prefill_block_tables": torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device
        ),
        "prefill_token_idx": token_idx,
        "prefill_slice": (prefills[0].start, prefills[-1].end) if contiguous else None,
    }


def _decode_key_slots(
    tables: torch.Tensor, visible: torch.Tensor, lens: list[int], first: list[int], block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block and offset ([B, keys] long each) of key j of each decode row, whose table starts at
    position first_i: the table's key j where `visible` ([B, keys] bool), the row's newest key
    (position len_i - 1, written this step) elsewhere, so a masked position never reads a slot
    that was never written (it may hold NaN; see pdkv.model.attention)."""
    keys = torch.arange(visible.shape[1], device=tables.device)[None, :]
    newest = (
        torch.tensor(lens, device=tables.device) - 1 - torch.tensor(first, device=tables.device)
    )[:, None]
    rel = torch.where(visible, keys, newest)
    return tables.gather(1, rel // block_size), rel % block_size


def build_dcp_attention_metadata(
    parallel: ParallelContext,
    requests: Sequence[StepRequest],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """With DCP this rank writes and attends only the tokens it stores (its shard): the
    metadata carries `dcp` (pdkv.model.dcp_attention.DCPMetadata) and no local slots."""
    from pdkv.model.dcp_attention import build_dcp_metadata

    empty = torch.tensor([], dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_block_ids=empty, slot_offsets=empty, prefills=[], decode_token_idx=None,
        decode_block_tables=None, decode_seq_lens=None, decode_mask=None, all_decode=False,
        dcp=build_dcp_metadata(parallel, block_size, requests, device),
    )


def build_linear_state_metadata(requests: Sequence[StepRequest], block_size: int,
                                device: torch.device | None = None) -> LinearStateMetadata:
    """Source slot and segments of each request of one step over its linear-state table
    (pdkv.cache.single_type_manager.LinearStateManager).

    The state after p tokens lives in entry min((p - 1) // block_size, len(table) - 1): a
    one-slot table keeps everything in its slot; a checkpoint table (one slot per block) keeps
    the state at the end of every full block in that block's slot. A request computing tokens
    c .. c+n-1 reads the state after c tokens (none: c == 0, fresh) and is split at every block
    boundary where the destination slot changes. The decode runs' slot tensors are built here
    on `device` (None: left to the layer, see LinearStateMetadata.decode_batches).
    """
    out = []
    for start, n, c, table in requests:
        src = _state_entry(table, c, block_size) if c > 0 else -1
        segments: list[tuple[int, int]] = []
        at = c
        while at < c + n:
            end = min((at // block_size + 1) * block_size, c + n)
            dst = _state_entry(table, end, block_size)
            if segments and segments[-1][1] == dst:
                segments[-1] = (segments[-1][0] + end - at, dst)
            else:
                segments.append((end - at, dst))
            at = end
        out.append((start, n, src, tuple(segments)))
    reqs = tuple(out)
    return LinearStateMetadata(reqs, None if device is None else decode_runs(reqs, device))


def build_v4_step_metadata(requests: Sequence[StepRequest],
                           block_ids: Sequence[Sequence[list[int]]],
                           groups: Sequence[KVCacheGroupSpec], meta: Sequence[Any],
                           device: torch.device) -> V4StepMetadata:
    """DeepSeek-V4's per-request view of one step: each request's block table (`block_ids`:
    per request, per KV cache group) under every cache layer of that group, and its
    compressor-state source slot and segments from the state group's LinearStateMetadata
    among the step's `meta` (none: fresh, one segment-less request)."""
    state = next((m for m in meta if isinstance(m, LinearStateMetadata)), None)
    out = []
    for i, ((start, n, c, _), tables_of) in enumerate(zip(requests, block_ids)):
        tables: dict[int, torch.Tensor] = {}
        for group, ids in zip(groups, tables_of):
            t = torch.tensor(ids, dtype=torch.long, device=device)
            tables.update((layer, t) for layer in group.layer_indices)
        src, segments = (state.requests[i][2], state.requests[i][3]) if state else (-1, ())
        out.append(V4StepRequest(start, n, c, tables, src, segments))
    return V4StepMetadata(tuple(out))


def _state_entry(table: list[int], num_tokens: int, block_size: int) -> int:
    """The slot holding a request's linear state after `num_tokens` (> 0) tokens."""
    return table[min((num_tokens - 1) // block_size, len(table) - 1)]


def build_pcp_step(
    parallel: ParallelContext,
    requests: Sequence[StepRequest],
    logits_idx: Sequence[int],
    block_size: int,
    device: torch.device,
    min_split_tokens: int | None = None,
) -> tuple[torch.Tensor, AttentionMetadata] | None:
    """This rank's part of a step under prefill context parallelism (pdkv.parallel.pcp).

    Args:
        parallel: the rank's context (pcp_size > 1; tp and dcp 1).
        requests: the whole step's requests in flat order (see StepRequest).
        logits_idx: flat indices whose logits are sampled (in the runner's order).
        block_size: tokens per block (the whole-model replica's block; no DCP).
        min_split_tokens: see plan_pcp_step (None: its default).

    Returns:
        None when the step is not split (every rank runs it whole); else (local_idx [T_local]
        long, the flat indices of the tokens this rank computes, in local order; the metadata of
        those tokens: a chunk of a split run is a run with context c + offset, `pcp` set).
    """
    from pdkv.model.pcp_attention import PCPMetadata
    from pdkv.parallel.pcp import plan_pcp_step

    plan = plan_pcp_step([n for _, n, _, _ in requests], parallel.pcp_size, min_split_tokens)
    if plan is None:
        return None
    rank, size = parallel.pcp_rank, parallel.pcp_size
    local_reqs: list[StepRequest] = []
    for run in plan.runs[rank]:
        _, _, c, table = requests[run.request]
        local_reqs.append((run.local_start, run.length, c + run.offset, table))
    num_local = plan.num_local(rank)
    meta = build_attention_metadata(local_reqs, num_local, block_size, device)
    width = max(plan.num_local(r) for r in range(size))
    owner, row = plan.owners()
    remote_idx: list[int] = []
    blocks: list[int] = []
    offsets: list[int] = []
    for start, n, c, table in requests:
        for t in range(start, start + n):
            if owner[t] != rank:
                remote_idx.append(owner[t] * width + row[t])
                p = c + t - start
                blocks.append(table[p // block_size])
                offsets.append(p % block_size)
    per_rank: list[list[int]] = [[] for _ in range(size)]
    logits_at: list[tuple[int, int]] = []
    for t in logits_idx:
        logits_at.append((owner[t], len(per_rank[owner[t]])))
        per_rank[owner[t]].append(row[t])
    logits_width = max(len(rows) for rows in per_rank)

    def long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    meta.pcp = PCPMetadata(
        parallel=parallel, width=width, remote_idx=long(remote_idx),
        remote_slot_blocks=long(blocks), remote_slot_offsets=long(offsets),
        logits_rows=long(per_rank[rank]), logits_width=logits_width,
        logits_idx=long([r * logits_width + i for r, i in logits_at]),
    )
    return long(plan.local_tokens(rank)), meta
