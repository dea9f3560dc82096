"""Re-sharding a linear-attention state slot across tensor parallelism (Gated DeltaNet). Torch-free.

One slot of the linear-state group (pdkv/worker/kv_cache.py, pdkv/model/qwen3_next.py) holds,
per linear layer l, a page of

    [conv window: local channels × (K - 1) values][recurrent state:
        local value heads × dk × dv float32]

at l × page_bytes(tp), page_bytes(tp) = channels / tp × conv_row_bytes + value heads / tp ×
rec_head_bytes. A TP rank's conv channels are [q part | k part | v part], each segment split over
the ranks on its own (`plan_segment_reads`, in channels); its recurrent heads are a contiguous
range of the value heads (`plan_head_reads`, per head). A consumer rank's slot is rebuilt from the
producer ranks' slots by the byte copies of `plan_state_copies`.
"""

from __future__ import annotations

from pdkv.cache.kv_layout import LAYOUT_KEY as LAYOUT_KEY
from pdkv.cache.kv_layout import StateGeometry as StateGeometry
from pdkv.kv_transfer.reblock import Copy
from pdkv.kv_transfer.reblock import _append as append_merged
from pdkv.kv_transfer.reshard import HeadRead, SegmentRead, plan_head_reads, plan_segment_reads

# StateGeometry and its layout key live with the KV layout (pdkv.cache.kv_layout).


def plan_state_copies(
    geom: StateGeometry,
    p_tp: int,
    d_tp: int,
    d_rank: int,
    p_slot: int,
    d_slot: int,
    p_rank: int | None = None,
) -> list[Copy]:
    """The byte copies that rebuild consumer TP rank `d_rank`'s slot `d_slot` from the producer
    ranks' slot `p_slot` (offsets from each side's group region: slot × slot_bytes(tp) + layer ×
    page_bytes(tp) + offset in the page); only those from producer rank `p_rank` when given.

    Returns:
        Copies in (layer, conv then recurrent) order, merged when contiguous on both sides (a
        whole slot when p_tp == d_tp).

    Raises:
        ValueError: a tp not dividing a conv segment or not dividing the value heads (named), or
            d_rank outside [0, d_tp).
    """
    if not 0 <= d_rank < d_tp:
        raise ValueError(f"consumer rank {d_rank} outside tensor_parallel_size={d_tp}")
    conv_plan, rec_plan = plan_state_reads(geom, p_tp, d_tp)
    conv, rec = conv_plan[d_rank], rec_plan[d_rank]
    p_page, d_page = geom.page_bytes(p_tp), geom.page_bytes(d_tp)
    p_conv, d_conv = geom.conv_bytes(p_tp), geom.conv_bytes(d_tp)
    row, head = geom.conv_row_bytes, geom.rec_head_bytes
    copies: list[Copy] = []
    for layer in range(geom.num_layers):
        p_at = p_slot * geom.slot_bytes(p_tp) + layer * p_page
        d_at = d_slot * geom.slot_bytes(d_tp) + layer * d_page
        for c in conv:
            if p_rank is None or c.p_rank == p_rank:
                append_merged(
                    copies, Copy(p_at + c.p_offset * row, d_at + c.d_offset * row, c.length * row)
                )
        for h in rec:
            if p_rank is None or h.p_rank == p_rank:
                append_merged(
                    copies,
                    Copy(
                        p_at + p_conv + h.p_head * head,
                        d_at + d_conv + h.d_head * head,
                        h.count * head,
                    ),
                )
    return copies


def plan_state_reads(geom: StateGeometry, p_tp: int, d_tp: int
                     ) -> tuple[dict[int, list[SegmentRead]], dict[int, list[HeadRead]]]:
    """Per consumer rank, the conv reads (channels, plan_segment_reads over q | k | v) and the
    recurrent-state reads (value heads, plan_head_reads).

    Raises:
        ValueError: p_tp or d_tp not dividing a conv segment or the value heads (named).
    """
    for tp, side in ((p_tp, "producer"), (d_tp, "consumer")):
        if tp < 1 or geom.rec_heads % tp:
            raise ValueError(
                f"{side} tensor_parallel_size={tp} does not divide the model's {geom.rec_heads} "
                "linear-attention value heads"
            )
    return plan_segment_reads(geom.conv_segments, p_tp, d_tp), plan_head_reads(
        p_tp, d_tp, geom.rec_heads
    )


def state_producer_ranks(geom: StateGeometry, p_tp: int, d_tp: int) -> dict[int, set[int]]:
    """For each consumer TP rank, the producer TP ranks its slot copies read from.

    Raises:
        ValueError: as plan_state_reads.
    """
    conv, rec = plan_state_reads(geom, p_tp, d_tp)
    return {d: {r.p_rank for r in conv[d]} | {r.p_rank for r in rec[d]} for d in range(d_tp)}
