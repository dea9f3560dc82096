"""Read planning of the P2P consumer: which ReadOps move a RecvSpec's blocks from one producer
rank into this worker's KV cache regions, for every layout pair the connector converts (same
layout, with DCP shards; re-blocking by token position, pdkv/kv_transfer/reblock.py; KV-head
re-sharding, pdkv/kv_transfer/reshard.py; a linear-state slot split over another TP size,
pdkv/kv_transfer/reshard_state.py). No I/O: the consumer side submits the ops."""

from __future__ import annotations

import functools
from collections.abc import Callable

from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import DTYPE_BYTES, QUANTIZED_KV_CACHE_DTYPES
from pdkv.jsontypes import as_int
from pdkv.kv_transfer.connector.p2p_messages import HandshakeReply, RecvSpec
from pdkv.kv_transfer.engine.base import ReadOp, TransferError
from pdkv.kv_transfer.reblock import plan_reblock
from pdkv.kv_transfer.reshard import HeadRead, plan_head_copies, plan_head_reads
from pdkv.kv_transfer.reshard_state import plan_state_copies
from pdkv.parallel.layout import ParallelLayout


class ReadPlanner:
    """Args:
        layout: this engine's KV layout (block_size, num_layers, heads, tp/dcp sizes).
        regions: this worker's KV cache bytes per group (the list is filled at register time).
        block_bytes: bytes per block of each group (likewise).
        rank: this worker's global rank; dcp_rank, dcp_size: its DCP rank and the DCP size.
    """

    def __init__(self, layout: KVLayout, regions: list[memoryview], block_bytes: list[int],
                 rank: int, dcp_rank: int, dcp_size: int) -> None:
        self.layout = layout
        self.regions = regions
        self.block_bytes = block_bytes
        self.rank = rank
        self.dcp_rank = dcp_rank
        self.dcp_size = dcp_size
        self.state = layout.linear_state  # a Gated DeltaNet state group, else None
        self.tp = layout.tp

    def block_ops(self, spec: RecvSpec, peer: HandshakeReply) -> list[ReadOp]:
        """The reads of this DCP rank's pairs (remote_first_block + i ≡ dcp_rank mod dcp_size);
        all pairs at dcp_size 1.

        Raises:
            TransferError: the producer's block bytes differ from this engine's.
        """
        p_heads = as_int(spec.remote_layout.get("num_kv_heads", 0))
        d_heads = self.layout.local_kv_heads
        if spec.remote_block_size and spec.remote_block_size != self.layout.block_size:
            return self.reblock_ops(spec, peer)
        if p_heads and d_heads and p_heads != d_heads:
            return self.head_ops(spec, peer, p_heads, d_heads)
        ops: list[ReadOp] = []
        n, r, first = self.dcp_size, self.dcp_rank, spec.remote_first_block
        for g, (all_local, all_remote) in enumerate(
            zip(spec.local_block_ids, spec.remote_block_ids)
        ):
            if (
                self.state is not None and g == self.state.group and self.tp != 1
            ):  # P tp 1, this rank's share
                ops.extend(self.state_ops(g, spec, peer, 1, 0))
                continue
            bb = self.block_bytes[g]
            if peer.block_bytes[g] != bb:
                raise TransferError(
                    f"block bytes differ: producer {peer.block_bytes[g]}, consumer {bb}"
                )
            mine = [i for i in range(len(all_local)) if (first + i) % n == r]
            local = [all_local[i] for i in mine]
            remote = [all_remote[i] for i in mine]
            # One op per run of blocks consecutive on both sides (fewer, larger copies).
            i = 0
            while i < len(local):
                j = i + 1
                while (
                    j < len(local)
                    and local[j] == local[j - 1] + 1
                    and remote[j] == remote[j - 1] + 1
                ):
                    j += 1
                nbytes = (j - i) * bb
                dest = self.regions[g][local[i] * bb : local[i] * bb + nbytes]
                ops.append(ReadOp(f"g{g}", remote[i] * bb, nbytes, dest))
                i = j
        return ops

    def head_planes(self, block_bytes: int, block_size: int, heads: int) -> tuple[int, list[int]]:
        """(layers, bytes of one KV head of one token in each plane of a layer's page, in page
        order) of this engine's blocks of `block_bytes` (block_size tokens, `heads` KV heads per
        layer). A plain page has one plane, head_size × dtype bytes; a quantized page
        (`--kv-cache-dtype int8 | fp8`) two, 1-byte values then a float32 scale: (head_size, 4).
        The layers are the group's own (a hybrid model's attention group holds only some).
        Both engines store the same kv_cache_dtype here (a dequantizing consumer takes whole
        blocks only). (0, []) when the bytes do not split so."""
        head = self.layout.head_size
        if self.layout.cache_dtype in QUANTIZED_KV_CACHE_DTYPES:
            units = [head, 4]
        else:
            units = [head * DTYPE_BYTES.get(self.layout.dtype, 0)]
        per_layer = 2 * block_size * heads * sum(units)
        if min(units) <= 0 or per_layer <= 0 or block_bytes % per_layer or not block_bytes:
            return 0, []
        return block_bytes // per_layer, units

    def dequantizes(self, spec: RecvSpec) -> bool:
        """Whether the producer's blocks are quantized and this engine's are not (they are read
        into staging memory and dequantized on arrival: `dequant_ops`)."""
        return (spec.remote_layout.get("kv_cache_dtype", "auto") in QUANTIZED_KV_CACHE_DTYPES
                and self.layout.cache_dtype == "auto")

    def dequant_ops(
        self, spec: RecvSpec, peer: HandshakeReply
    ) -> tuple[list[ReadOp], Callable[[], None]]:
        """Reads of the producer's whole quantized blocks into staging memory (one op per block;
        bytes moved = the producer's smaller blocks), and the step that dequantizes them into
        this engine's blocks (pdkv/kv_transfer/kv_dequant.py), to run once the reads finished.
        Equal block sizes and heads, dcp 1 (the scheduler half refuses the rest).

        Raises:
            TransferError: the producer's block bytes are not quantized pages of this engine's
                layers.
        """
        from pdkv.kv_transfer.kv_dequant import dequantize_blocks

        lay = spec.remote_layout
        bs = self.layout.block_size
        heads, head = as_int(lay["num_kv_heads"]), as_int(lay["head_size"])
        page = 2 * bs * heads * head + 2 * bs * heads * 4
        ops: list[ReadOp] = []
        steps: list[Callable[[], None]] = []
        for g, (local, remote) in enumerate(zip(spec.local_block_ids, spec.remote_block_ids)):
            p_bb, bb = peer.block_bytes[g], self.block_bytes[g]
            layers = p_bb // page
            if p_bb % page or not layers or bb % (layers * 2 * bs * heads * head):
                raise TransferError(
                    f"producer block bytes {p_bb} are not quantized pages of {page} bytes "
                    f"for this engine's block bytes {bb}"
                )
            staged = memoryview(bytearray(p_bb * len(remote)))
            ops.extend(
                ReadOp(f"g{g}", r * p_bb, p_bb, staged[i * p_bb : (i + 1) * p_bb])
                for i, r in enumerate(remote)
            )
            steps.append(functools.partial(
                dequantize_blocks, staged, self.regions[g], list(local), bs, heads, head,
                str(lay["kv_cache_dtype"]), self.layout.dtype))

        def finish() -> None:
            for step in steps:
                step()

        return ops, finish

    def reblock_ops(self, spec: RecvSpec, peer: HandshakeReply) -> list[ReadOp]:
        """Re-blocking reads (the producer's block size differs from this engine's): one ReadOp
        per copy of the planner, per group.

        Raises:
            TransferError: the bytes per token row differ between the engines, or the blocks do
                not cover the token range.
        """
        d_bs, p_bs = self.layout.block_size, spec.remote_block_size
        heads = self.layout.local_kv_heads
        ops: list[ReadOp] = []
        for g, (local, remote) in enumerate(zip(spec.local_block_ids, spec.remote_block_ids)):
            bb, p_bb = self.block_bytes[g], peer.block_bytes[g]
            layers, units = self.head_planes(bb, d_bs, heads)
            rows = [heads * u for u in units]  # a token row of each plane
            if not rows or p_bb != layers * 2 * p_bs * sum(rows):
                raise TransferError(
                    f"block bytes do not re-block: producer {p_bb} for block_size {p_bs}, "
                    f"consumer {bb} for block_size {d_bs}, {layers} layers, token rows {rows}"
                )
            try:
                copies = plan_reblock(
                    remote,
                    p_bs,
                    local,
                    d_bs,
                    layers,
                    rows,
                    spec.first_token,
                    spec.end_token,
                    spec.remote_first_block,
                    spec.first_token // d_bs,
                )
            except ValueError as e:
                raise TransferError(f"re-blocking plan: {e}") from None
            region = self.regions[g]
            ops.extend(
                ReadOp(
                    f"g{g}",
                    c.remote_offset,
                    c.nbytes,
                    region[c.local_offset : c.local_offset + c.nbytes],
                )
                for c in copies
            )
        return ops

    def head_ops(
        self, spec: RecvSpec, peer: HandshakeReply, p_heads: int, d_heads: int
    ) -> list[ReadOp]:
        """Re-sharding reads (this rank stores `d_heads` of the producer's `p_heads` KV heads; P tp
        1, dcp 1, equal block sizes): one ReadOp per copy of plan_head_copies, per group.

        Raises:
            TransferError: the block bytes do not split into the heads of both sides, or a
                layout the planner refuses.
        """
        tp = self.layout.tp
        lay = ParallelLayout(tp_size=tp, dcp_size=self.layout.dcp,
                             dcp_replicated=bool(self.layout.dcp_replicated))
        try:
            reads = plan_head_reads(1, tp, p_heads)[lay.tp_rank(self.rank)]
        except ValueError as e:
            raise TransferError(f"re-sharding plan: {e}") from None
        return self.copy_ops(spec, peer, p_heads, d_heads, reads)

    def copy_ops(self, spec: RecvSpec, peer: HandshakeReply, p_heads: int, d_heads: int,
                  reads: list[HeadRead], p_tp: int = 1, p_rank: int = 0) -> list[ReadOp]:
        """One ReadOp per copy of plan_head_copies for `reads` from the producer rank `peer`
        (TP rank `p_rank` of `p_tp`, storing `p_heads` KV heads per block) into this rank
        (`d_heads`), per group; a linear-state group's slot by `state_ops`.

        Raises:
            TransferError: the block bytes do not split into the heads of both sides.
        """
        bs = self.layout.block_size
        ops: list[ReadOp] = []
        for g, (local, remote) in enumerate(zip(spec.local_block_ids, spec.remote_block_ids)):
            if self.state is not None and g == self.state.group:
                ops.extend(self.state_ops(g, spec, peer, p_tp, p_rank))
                continue
            bb, p_bb = self.block_bytes[g], peer.block_bytes[g]
            layers, units = self.head_planes(bb, bs, d_heads)
            if not units or p_bb != layers * 2 * bs * p_heads * sum(units):
                raise TransferError(
                    f"block bytes do not re-shard: producer {p_bb} for {p_heads} KV heads, "
                    f"consumer {bb} for {d_heads}, block_size {bs}, {layers} layers, "
                    f"bytes per head {units}"
                )
            region = self.regions[g]
            copies = plan_head_copies(remote, local, bs, layers, units, p_heads, d_heads, reads)
            ops.extend(
                ReadOp(
                    f"g{g}",
                    c.remote_offset,
                    c.nbytes,
                    region[c.local_offset : c.local_offset + c.nbytes],
                )
                for c in copies
            )
        return ops

    def state_ops(
        self, g: int, spec: RecvSpec, peer: HandshakeReply, p_tp: int, p_rank: int
    ) -> list[ReadOp]:
        """The reads of this rank's share of each linear-state slot of group `g` from producer TP
        rank `p_rank` of `p_tp` (`peer`): one ReadOp per copy of plan_state_copies (conv channels
        per q | k | v segment, recurrent state per value head).

        Raises:
            TransferError: either side's slot bytes are not the geometry's at its tp, or a tp
                pair the planner refuses (named).
        """
        geom = self.state
        assert geom is not None
        bb, p_bb = self.block_bytes[g], peer.block_bytes[g]
        if bb != geom.slot_bytes(self.tp) or p_bb != geom.slot_bytes(p_tp):
            raise TransferError(
                f"linear-state slot bytes do not re-shard: producer {p_bb} at tp_size={p_tp}, "
                f"consumer {bb} at tp_size={self.tp} (expected {geom.slot_bytes(p_tp)} and "
                f"{geom.slot_bytes(self.tp)})"
            )
        me = ParallelLayout(tp_size=self.tp).tp_rank(self.rank)
        region, ops = self.regions[g], list[ReadOp]()
        for local, remote in zip(spec.local_block_ids[g], spec.remote_block_ids[g]):
            try:
                copies = plan_state_copies(geom, p_tp, self.tp, me, remote, local, p_rank)
            except ValueError as e:
                raise TransferError(f"linear-state re-sharding plan: {e}") from None
            ops.extend(
                ReadOp(
                    f"g{g}",
                    c.remote_offset,
                    c.nbytes,
                    region[c.local_offset : c.local_offset + c.nbytes],
                )
                for c in copies
            )
        return ops
