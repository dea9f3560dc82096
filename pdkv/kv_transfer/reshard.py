"""Re-sharding planner: which reads move KV heads (and other tensors sharded over tensor
parallelism) from a producer at `p_tp` ranks into a consumer at `d_tp` ranks. Torch-free.

Heads are placed as ParallelLayout places them (pdkv/parallel/layout.py): with tp ≤ KV heads,
rank r holds heads [r·H/tp, (r+1)·H/tp); with tp > KV heads, tp / H consecutive ranks share one
head (replicated). A consumer rank needs exactly its own heads; each comes from one producer rank
that holds it (several do when P replicates it: D ranks are spread over them).

Within a block ([num_layers, 2, block_size, num_kv_heads, head_size] contiguous, docs/
ARCHITECTURE.md "KV cache layout") a head sub-range is contiguous only inside one token row, so
`plan_head_copies` emits one copy per (block, layer, K/V, token) unless the ranges are whole rows
(equal heads), which merge into whole blocks.

`plan_segment_reads` covers a tensor whose sharded dimension concatenates several sub-tensors,
each sharded on its own (a fused [q | k | v] projection, a linear-attention conv state): rank r's
local tensor is [seg0 part r | seg1 part r | ...].

MLA blocks ("blocks_layers_tokens_latent") have no heads: every rank holds the whole latent, so
a consumer rank reads whole blocks from one producer rank and never comes here (a producer at
tp > 1 on MLA is refused by `pdkv.kv_transfer.connector.p2p_compat.mla_error`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from pdkv.kv_transfer.reblock import Copy
from pdkv.kv_transfer.reblock import _append as append_merged
from pdkv.parallel.layout import ParallelLayout


class HeadRead(NamedTuple):
    """`count` heads from producer rank `p_rank`'s local head `p_head` on into the consumer rank's
    local head `d_head` on (local indices: 0 = the rank's first head)."""

    p_rank: int
    p_head: int
    d_head: int
    count: int  # type: ignore[assignment]  # a field named like tuple.count (mypy refuses it)


class SegmentRead(NamedTuple):
    """`length` elements at `p_offset` of producer rank `p_rank`'s local tensor to `d_offset` of
    the consumer rank's local tensor (elements along the sharded dimension)."""

    p_rank: int
    p_offset: int
    d_offset: int
    length: int


def _holders(tp: int, num_kv_heads: int, head: int) -> list[int]:
    """Ranks of a tp-way layout that hold global KV head `head`."""
    if tp <= num_kv_heads:
        return [head // (num_kv_heads // tp)]
    rep = tp // num_kv_heads
    return list(range(head * rep, (head + 1) * rep))


def _check(side: str, tp: int, num_kv_heads: int) -> None:
    if tp < 1 or num_kv_heads < 1:
        raise ValueError(
            f"{side} tensor_parallel_size={tp} and num_kv_heads={num_kv_heads} must be >= 1"
        )
    try:  # query heads chosen so that only the KV-head rule can fail
        ParallelLayout(tp_size=tp).check_heads(tp * num_kv_heads, num_kv_heads)
    except ValueError as e:
        raise ValueError(f"{side}: {e}") from None


def plan_head_reads(p_tp: int, d_tp: int, num_kv_heads: int) -> dict[int, list[HeadRead]]:
    """For each consumer rank (TP rank 0 .. d_tp - 1), the reads that fill its local KV heads.

    A head several producer ranks hold is read from holder (d rank mod holders); consecutive heads
    that are consecutive on both sides and come from one producer rank form one HeadRead.

    Raises:
        ValueError: a size below 1, or tp and the KV heads not dividing one another on either side
            (ParallelLayout.check_heads); the message names the side and the values.
    """
    _check("producer", p_tp, num_kv_heads)
    _check("consumer", d_tp, num_kv_heads)
    p_lay, d_lay = ParallelLayout(tp_size=p_tp), ParallelLayout(tp_size=d_tp)
    plan: dict[int, list[HeadRead]] = {}
    for d in range(d_tp):
        start = d_lay.kv_head_start(d, num_kv_heads)
        reads: list[HeadRead] = []
        for i in range(d_lay.kv_heads_per_rank(num_kv_heads)):
            holders = _holders(p_tp, num_kv_heads, start + i)
            p = holders[d % len(holders)]
            p_head = start + i - p_lay.kv_head_start(p, num_kv_heads)
            last = reads[-1] if reads else None
            if (
                last
                and last.p_rank == p
                and last.p_head + last.count == p_head
                and last.d_head + last.count == i
            ):
                reads[-1] = last._replace(count=last.count + 1)
            else:
                reads.append(HeadRead(p, p_head, i, 1))
        plan[d] = reads
    return plan


def plan_segment_reads(
    segment_sizes: Sequence[int], p_tp: int, d_tp: int
) -> dict[int, list[SegmentRead]]:
    """For each consumer rank, the reads that rebuild its local shard of a tensor whose sharded
    dimension concatenates segments of `segment_sizes` elements, each split evenly over tp.

    Reads contiguous on both sides (same producer rank) are merged.

    Raises:
        ValueError: a size below 1, or p_tp or d_tp not dividing a segment (both named).
    """
    if p_tp < 1 or d_tp < 1 or not segment_sizes or min(segment_sizes) < 1:
        raise ValueError(
            f"segment_sizes={list(segment_sizes)}, p_tp={p_tp} and d_tp={d_tp} must be >= 1"
        )
    for tp, side in ((p_tp, "producer"), (d_tp, "consumer")):
        bad = [s for s in segment_sizes if s % tp]
        if bad:
            raise ValueError(
                f"{side} tensor_parallel_size={tp} does not divide segment size(s) {bad} "
                f"of {list(segment_sizes)}"
            )
    plan: dict[int, list[SegmentRead]] = {}
    for d in range(d_tp):
        reads: list[SegmentRead] = []
        p_base = d_base = 0  # where the segment's part starts in a producer / consumer local tensor
        for size in segment_sizes:
            p_part, d_part = size // p_tp, size // d_tp
            g, end = d * d_part, (d + 1) * d_part  # global range of the segment this rank needs
            while g < end:
                p = g // p_part
                n = min(end, (p + 1) * p_part) - g
                r = SegmentRead(p, p_base + g - p * p_part, d_base + g - d * d_part, n)
                last = reads[-1] if reads else None
                if (last and last.p_rank == p and last.p_offset + last.length == r.p_offset
                        and last.d_offset + last.length == r.d_offset):
                    reads[-1] = last._replace(length=last.length + n)
                else:
                    reads.append(r)
                g += n
            p_base += p_part
            d_base += d_part
        plan[d] = reads
    return plan


def plan_head_copies(
    p_block_ids: Sequence[int],
    d_block_ids: Sequence[int],
    block_size: int,
    num_layers: int,
    head_bytes: int | Sequence[int],
    p_heads: int,
    d_heads: int,
    reads: Sequence[HeadRead],
) -> list[Copy]:
    """The byte copies that fill the consumer's heads of blocks `d_block_ids` from the producer's
    `p_block_ids` (paired in order, equal block sizes), for `reads` (one producer rank's, from
    plan_head_reads).

    Byte offsets (from each region's start) follow the block layout: head h of token slot s of
    layer l, K (k = 0) or V (k = 1) of block b starts at
    b × block_bytes + (((l × 2 + k) × block_size + s) × heads + h) × head_bytes, with
    block_bytes = num_layers × 2 × block_size × heads × head_bytes on each side. With one
    head_bytes per plane (u_0, u_1, ...: a quantized page holds, per layer, the 1-byte values,
    u_0 = head_size, then the float32 scales, u_1 = 4) a layer's page is 2 × block_size × heads ×
    Σ u_i bytes and plane i's head h of row (k, s) starts at
    b × block_bytes + l × page + 2 × block_size × heads × Σ_{j<i} u_j + ((k × block_size + s) ×
    heads + h) × u_i.

    Returns:
        Copies in producer order, merged when contiguous on both sides (whole blocks when every
        read covers whole rows of both sides).

    Raises:
        ValueError: a non-positive size, lists of different lengths, or a read outside either
            side's heads.
    """
    units = [head_bytes] if isinstance(head_bytes, int) else list(head_bytes)
    if not units or min(block_size, num_layers, p_heads, d_heads, *units) <= 0:
        raise ValueError("block_size, num_layers, head_bytes and head counts must be positive")
    if len(p_block_ids) != len(d_block_ids):
        raise ValueError(
            f"{len(p_block_ids)} producer blocks paired with {len(d_block_ids)} consumer blocks"
        )
    for r in reads:
        if (
            r.count < 1
            or r.p_head < 0
            or r.d_head < 0
            or r.p_head + r.count > p_heads
            or r.d_head + r.count > d_heads
        ):
            raise ValueError(
                f"{r} lies outside the producer's {p_heads} or the consumer's {d_heads} local heads"
            )
    rows = 2 * block_size  # rows of one plane of one layer
    p_bb, d_bb = num_layers * rows * p_heads * sum(units), num_layers * rows * d_heads * sum(units)
    copies: list[Copy] = []
    for pb, db in zip(p_block_ids, d_block_ids):
        p_at, d_at = pb * p_bb, db * d_bb
        for _ in range(num_layers):
            for unit in units:  # the page's planes, in order
                for _row in range(rows):
                    for r in reads:
                        append_merged(
                            copies,
                            Copy(p_at + r.p_head * unit, d_at + r.d_head * unit, r.count * unit),
                        )
                    p_at += p_heads * unit
                    d_at += d_heads * unit
    return copies


def plan_producer_readers(p_tp: int, d_tp: int, num_kv_heads: int,
                          extra: Mapping[int, Iterable[int]] | None = None) -> dict[int, list[int]]:
    """For each producer rank (TP rank 0 .. p_tp - 1), the consumer TP ranks that claim its grant
    and say "done" to it (its grant's readers): those plan_head_reads makes read from it, and
    those `extra` (consumer rank -> producer ranks; e.g. a linear-state slot's,
    pdkv.kv_transfer.reshard_state.state_producer_ranks) names. A
    producer rank no consumer rank reads from (it replicates a head another producer rank
    serves) gets consumer rank 0, which claims, reads nothing and says "done", so that every
    producer rank frees its blocks once its readers are done.

    Raises:
        ValueError: as plan_head_reads.
    """
    readers: dict[int, list[int]] = {p: [] for p in range(p_tp)}
    for d, reads in plan_head_reads(p_tp, d_tp, num_kv_heads).items():
        for p in sorted({r.p_rank for r in reads} | set((extra or {}).get(d, ()))):
            readers[p].append(d)
    return {p: ds or [0] for p, ds in readers.items()}
