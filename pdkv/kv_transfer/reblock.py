"""Re-blocking planner: which byte copies move a token range of KV from a producer whose blocks
hold `p_block_size` tokens into a consumer whose blocks hold `d_block_size` tokens. Torch-free.

Both sides use the cross-layer layout ("blocks_layers_kv_tokens_heads_dim", docs/ARCHITECTURE.md
"KV cache layout"): block b is one contiguous run of [num_layers, 2, block_size, num_kv_heads,
head_size] at byte b × block_bytes, so token t (slot s = t mod block_size of block index
t // block_size) of layer l, K (k = 0) or V (k = 1) starts at

    block_id × block_bytes + ((l × 2 + k) × block_size + s) × row_bytes

with row_bytes = num_kv_heads × head_size × dtype bytes and block_bytes = num_layers × 2 ×
block_size × row_bytes. A quantized page (`--kv-cache-dtype int8 | fp8`, docs/ARCHITECTURE.md
"Quantized KV cache") holds, per layer, two such planes one after the other: 1-byte values
(row H·D bytes), then float32 scales (row H·4 bytes); with row sizes r_0, r_1, ... per plane a
layer's page is 2 × block_size × Σ r_i bytes and plane i's row (k, s) of layer l starts at

    block_id × block_bytes + l × page + 2 × block_size × Σ_{j<i} r_j + (k × block_size + s) × r_i

With different block sizes a producer block is not a contiguous part of
a consumer block, but for each (layer, K/V) the rows of a run of tokens that lies inside one
producer block and one consumer block are contiguous on both sides: one copy per such run.
Copies contiguous on both sides are merged (equal block sizes give whole-block copies).
A push across block sizes gathers each consumer (block, layer) unit the same way
(`plan_unit_gather`): the consumer accepts only whole units.
MLA blocks ("blocks_layers_tokens_latent": [num_layers, block_size, latent + rope], no K/V
halves) do not fit this formula; re-blocking them is refused before planning
(`pdkv.kv_transfer.connector.p2p_compat.mla_error`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Copy(NamedTuple):
    """Copy `nbytes` bytes at `remote_offset` of the producer's region to `local_offset` of the
    consumer's region (bytes from the region's start)."""

    remote_offset: int
    local_offset: int
    nbytes: int


def plan_reblock(
    p_block_ids: Sequence[int],
    p_block_size: int,
    d_block_ids: Sequence[int],
    d_block_size: int,
    num_layers: int,
    row_bytes: int | Sequence[int],
    first_token: int,
    end_token: int,
    p_first_block: int = 0,
    d_first_block: int = 0,
) -> list[Copy]:
    """The copies that move tokens [first_token, end_token) of every layer's K and V.

    Args:
        p_block_ids: producer block ids; p_block_ids[i] holds tokens of block index
            p_first_block + i, i.e. [(p_first_block + i) × p_block_size, ...).
        p_block_size, d_block_size: tokens per block on each side.
        d_block_ids: consumer block ids, d_block_ids[i] for block index d_first_block + i.
        num_layers: layers in each block.
        row_bytes: bytes of one token of one layer's K (or V): num_kv_heads × head_size × dtype
            bytes; or one such size per plane of a layer's page, in page order (a quantized
            page: (H·D, H·4), values then scales).
        first_token, end_token: the absolute token range to move (end exclusive).

    Returns:
        Copies in producer order. With equal block sizes and `first_token` on a block boundary
        every copy is whole blocks (a run of blocks consecutive on both sides; the last block's
        slots past `end_token` come along, as before re-blocking existed); otherwise no byte
        outside the range is written.

    Raises:
        ValueError: a non-positive size, an empty or negative range, or a token of the range
            that no given block holds.
    """
    rows = [row_bytes] if isinstance(row_bytes, int) else list(row_bytes)
    if not rows or min(p_block_size, d_block_size, num_layers, *rows) <= 0:
        raise ValueError("block sizes, num_layers and row_bytes must be positive")
    if not 0 <= first_token < end_token:
        raise ValueError(f"token range [{first_token}, {end_token}) is empty or negative")
    p_end = (p_first_block + len(p_block_ids)) * p_block_size
    d_end = (d_first_block + len(d_block_ids)) * d_block_size
    if first_token < p_first_block * p_block_size or end_token > p_end:
        raise ValueError(f"producer blocks cover [{p_first_block * p_block_size}, {p_end}), "
                         f"not [{first_token}, {end_token})")
    if first_token < d_first_block * d_block_size or end_token > d_end:
        raise ValueError(f"consumer blocks cover [{d_first_block * d_block_size}, {d_end}), "
                         f"not [{first_token}, {end_token})")
    p_bb = num_layers * 2 * p_block_size * sum(rows)
    d_bb = num_layers * 2 * d_block_size * sum(rows)
    if p_block_size == d_block_size and first_token % p_block_size == 0:
        return _whole_blocks(p_block_ids, d_block_ids, p_first_block, d_first_block,
                             first_token // p_block_size, -(-end_token // p_block_size), p_bb)
    copies: list[Copy] = []
    t = first_token
    while t < end_token:  # runs of tokens inside one P block and one D block
        pi, ps = divmod(t, p_block_size)
        di, ds = divmod(t, d_block_size)
        n = min(end_token - t, p_block_size - ps, d_block_size - ds)
        p_base = p_block_ids[pi - p_first_block] * p_bb
        d_base = d_block_ids[di - d_first_block] * d_bb
        for layer in range(num_layers):
            p_at, d_at = p_base + layer * p_bb // num_layers, d_base + layer * d_bb // num_layers
            for row in rows:  # the page's planes, in order
                for k in range(2):
                    _append(
                        copies,
                        Copy(
                            p_at + (k * p_block_size + ps) * row,
                            d_at + (k * d_block_size + ds) * row,
                            n * row,
                        ),
                    )
                p_at += 2 * p_block_size * row
                d_at += 2 * d_block_size * row
        t += n
    return copies


def plan_unit_gather(
    p_block_ids: Sequence[int],
    p_first_block: int,
    p_block_size: int,
    d_block_size: int,
    d_index: int,
    layer: int,
    num_layers: int,
    row_bytes: Sequence[int],
    num_tokens: int,
) -> list[Copy]:
    """The copies that fill one consumer (layer, block) unit from the producer's blocks: a
    push across block sizes writes each consumer block's layer as one unit, gathered first.

    The unit is layer `layer`'s page of consumer block index `d_index`: 2 × d_block_size ×
    Σ row_bytes bytes, laid out as in a consumer block (module doc: per plane, K rows then V
    rows of d_block_size slots). Its tokens are [d_index × d_block_size, min((d_index + 1) ×
    d_block_size, num_tokens)); slots past `num_tokens` are written by no copy.

    Args:
        p_block_ids: producer block ids; p_block_ids[i] holds block index p_first_block + i.
        p_first_block: block index (producer block size) of p_block_ids[0].
        p_block_size, d_block_size: tokens per block on each side.
        d_index: the consumer block's index (consumer block size).
        layer: the layer within the group (0 .. num_layers - 1).
        num_layers: layers per block of the group.
        row_bytes: bytes of one token's K (or V) per plane of a layer's page, in page order.
        num_tokens: the prompt's tokens.

    Returns:
        Copies with `remote_offset` from the start of the producer's region and `local_offset`
        from the start of the unit, in token order, merged where contiguous on both sides.

    Raises:
        ValueError: a non-positive size, a layer outside the block, a unit with no token of the
            prompt, or a token of the unit that no given producer block holds.
    """
    rows = list(row_bytes)
    if not rows or min(p_block_size, d_block_size, num_layers, *rows) <= 0:
        raise ValueError("block sizes, num_layers and row_bytes must be positive")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} is not one of the block's {num_layers} layers")
    first, end = d_index * d_block_size, min((d_index + 1) * d_block_size, num_tokens)
    if not 0 <= first < end:
        raise ValueError(f"consumer block {d_index} holds no token of a {num_tokens}-token prompt")
    p_end = (p_first_block + len(p_block_ids)) * p_block_size
    if first < p_first_block * p_block_size or end > p_end:
        raise ValueError(f"producer blocks cover [{p_first_block * p_block_size}, {p_end}), "
                         f"not [{first}, {end})")
    page = 2 * p_block_size * sum(rows)  # one layer's bytes of a producer block
    copies: list[Copy] = []
    t = first
    while t < end:  # runs of the unit's tokens inside one producer block
        pi, ps = divmod(t, p_block_size)
        ds = t - first
        n = min(end - t, p_block_size - ps)
        p_at = p_block_ids[pi - p_first_block] * num_layers * page + layer * page
        d_at = 0
        for row in rows:  # the page's planes, in order
            for k in range(2):
                _append(copies, Copy(p_at + (k * p_block_size + ps) * row,
                                     d_at + (k * d_block_size + ds) * row, n * row))
            p_at += 2 * p_block_size * row
            d_at += 2 * d_block_size * row
        t += n
    return copies


def _whole_blocks(p_ids: Sequence[int], d_ids: Sequence[int], p_first: int, d_first: int,
                  first_block: int, end_block: int, block_bytes: int) -> list[Copy]:
    copies: list[Copy] = []
    for k in range(first_block, end_block):
        _append(
            copies,
            Copy(p_ids[k - p_first] * block_bytes, d_ids[k - d_first] * block_bytes, block_bytes),
        )
    return copies


def _append(copies: list[Copy], c: Copy) -> None:
    """Append `c`, merged into the last copy when contiguous with it on both sides."""
    if copies:
        last = copies[-1]
        if (
            last.remote_offset + last.nbytes == c.remote_offset
            and last.local_offset + last.nbytes == c.local_offset
        ):
            copies[-1] = Copy(last.remote_offset, last.local_offset, last.nbytes + c.nbytes)
            return
    copies.append(c)
