"""Re-blocking planner (pdkv/kv_transfer/reblock.py): copies applied to a byte-array "P cache" with
a distinct marker per (layer, K/V, token) land every token row of the range at D's (block, layer,
K/V, slot) and write nothing else. Torch-free."""

from __future__ import annotations

import random
import struct

import pytest

from pdkv.kv_transfer.reblock import Copy, plan_reblock, plan_unit_gather

LAYERS = 3
ROW = 8  # bytes per token row: two int32, both the marker
EMPTY = b"\xee" * ROW


def marker(layer: int, kv: int, token: int) -> bytes:
    return struct.pack("<ii", 1 + (layer * 2 + kv) * 100_000 + token, -(1 + token))


def row_at(block_id: int, block_size: int, layer: int, kv: int, slot: int) -> int:
    return block_id * LAYERS * 2 * block_size * ROW + ((layer * 2 + kv) * block_size + slot) * ROW


def p_cache(ids: list[int], bs: int, num_blocks: int, first_block: int = 0) -> bytearray:
    buf = bytearray(EMPTY * (num_blocks * LAYERS * 2 * bs))
    for i, b in enumerate(ids):
        for slot in range(bs):
            t = (first_block + i) * bs + slot
            for layer in range(LAYERS):
                for kv in range(2):
                    off = row_at(b, bs, layer, kv, slot)
                    buf[off : off + ROW] = marker(layer, kv, t)
    return buf


def apply(copies: list[Copy], src: bytearray, dst: bytearray) -> None:
    for c in copies:
        assert c.nbytes > 0 and c.nbytes % ROW == 0
        dst[c.local_offset : c.local_offset + c.nbytes] = src[
            c.remote_offset : c.remote_offset + c.nbytes
        ]


def run_case(
    rng: random.Random, p_bs: int, d_bs: int, first: int, end: int
) -> tuple[list[Copy], bytearray, dict]:
    """Random P and D block tables covering [first, end) (from the blocks holding `first`)."""
    nblocks = 24
    p_first, d_first = first // p_bs, first // d_bs
    p_ids = rng.sample(range(nblocks), -(-end // p_bs) - p_first)
    d_ids = rng.sample(range(nblocks), -(-end // d_bs) - d_first)
    src = p_cache(p_ids, p_bs, nblocks, p_first)
    dst = bytearray(EMPTY * (nblocks * LAYERS * 2 * d_bs))
    copies = plan_reblock(p_ids, p_bs, d_ids, d_bs, LAYERS, ROW, first, end, p_first, d_first)
    apply(copies, src, dst)
    expected = {}  # D row offset -> marker, for every token of the range
    for t in range(first, end):
        b = d_ids[t // d_bs - d_first]
        for layer in range(LAYERS):
            for kv in range(2):
                expected[row_at(b, d_bs, layer, kv, t % d_bs)] = marker(layer, kv, t)
    return copies, dst, {"expected": expected, "d_ids": d_ids, "d_first": d_first, "src": src,
                         "p_ids": p_ids, "p_first": p_first}


SIZES = [(16, 32), (32, 16), (16, 16), (32, 32), (16, 48), (48, 32)]


@pytest.mark.parametrize(("p_bs", "d_bs"), SIZES)
def test_every_token_row_lands_in_place_and_nothing_else_is_written(p_bs, d_bs):
    rng = random.Random(p_bs * 1000 + d_bs)
    for _ in range(12):
        end = rng.randint(1, 150)
        # D's local prefix hit ends at one of its block boundaries; also arbitrary starts.
        first = rng.choice([(end - 1) // d_bs * d_bs * rng.randint(0, 1), rng.randrange(end)])
        copies, dst, info = run_case(rng, p_bs, d_bs, first, end)
        for off, m in info["expected"].items():
            assert dst[off : off + ROW] == m, f"row at {off} of [{first}, {end}) {p_bs}->{d_bs}"
        whole = p_bs == d_bs and first % p_bs == 0
        for off in range(0, len(dst), ROW):
            if off in info["expected"]:
                continue
            if whole and off // (LAYERS * 2 * d_bs * ROW) in info["d_ids"]:
                continue  # whole-block copies: the last block's slots past `end` come along
            assert dst[off : off + ROW] == EMPTY, (
                f"row at {off} outside [{first}, {end}) was written"
            )


@pytest.mark.parametrize("bs", [16, 32])
def test_equal_block_sizes_copy_whole_blocks(bs):
    bb = LAYERS * 2 * bs * ROW
    copies = plan_reblock([7, 3, 4, 9], bs, [1, 2, 3, 8], bs, LAYERS, ROW, 0, 3 * bs + 5)
    # blocks (3, 4) -> (2, 3) are consecutive on both sides: one copy
    assert copies == [
        Copy(7 * bb, 1 * bb, bb),
        Copy(3 * bb, 2 * bb, 2 * bb),
        Copy(9 * bb, 8 * bb, bb),
    ]
    tail = plan_reblock(
        [3, 4], bs, [5, 6], bs, LAYERS, ROW, 2 * bs, 3 * bs + 1, p_first_block=2, d_first_block=2
    )
    assert tail == [Copy(3 * bb, 5 * bb, 2 * bb)]  # mid-table start, last block partial


def test_sixteen_to_thirty_two_is_one_copy_per_layer_kv_and_p_block():
    copies = plan_reblock([5, 9, 1], 16, [2, 7], 32, LAYERS, ROW, 0, 40)
    assert len(copies) == 3 * LAYERS * 2
    assert sum(c.nbytes for c in copies) == 40 * LAYERS * 2 * ROW


@pytest.mark.parametrize(
    ("first", "end", "pf", "df", "np_", "nd"),
    [
        (0, 0, 0, 0, 1, 1),
        (5, 3, 0, 0, 1, 1),
        (0, 40, 0, 0, 2, 2),
        (0, 40, 0, 0, 3, 1),
        (16, 20, 2, 0, 1, 1),
    ],
)
def test_ranges_the_blocks_do_not_cover_are_refused(first, end, pf, df, np_, nd):
    with pytest.raises(ValueError):
        plan_reblock(list(range(np_)), 16, list(range(nd)), 32, LAYERS, ROW, first, end, pf, df)


# ------------------------------------------------------------------ quantized pages: two planes
VALUES, SCALES = 6, 2  # bytes of one token row in each plane (1-byte values, then scales)


def quant_row_at(block_id: int, bs: int, layer: int, plane: int, kv: int, slot: int) -> int:
    page = 2 * bs * (VALUES + SCALES)
    base = 2 * bs * VALUES if plane else 0
    return (
        block_id * LAYERS * page
        + layer * page
        + base
        + (kv * bs + slot) * (SCALES if plane else VALUES)
    )


def quant_marker(layer: int, plane: int, kv: int, token: int) -> bytes:
    n = SCALES if plane else VALUES
    return bytes((layer * 37 + plane * 101 + kv * 53 + token * 7 + i) % 251 + 1 for i in range(n))


@pytest.mark.parametrize(("p_bs", "d_bs"), SIZES)
def test_quantized_pages_move_values_and_scales_rows_of_every_token(p_bs, d_bs):
    """A page of two planes (values rows of 6 bytes, then scale rows of 2): after the copies every
    token of the range has both rows at D's (block, layer, plane, K/V, slot), nothing else is
    written (beyond whole blocks at equal sizes), and the byte count is tokens × layers × 2 × 8."""
    rng = random.Random(7 * p_bs + d_bs)
    nblocks = 24
    for _ in range(8):
        end = rng.randint(1, 150)
        first = rng.choice([0, rng.randrange(end)])
        p_first, d_first = first // p_bs, first // d_bs
        p_ids = rng.sample(range(nblocks), -(-end // p_bs) - p_first)
        d_ids = rng.sample(range(nblocks), -(-end // d_bs) - d_first)
        src = bytearray(b"\xee" * (nblocks * LAYERS * 2 * p_bs * (VALUES + SCALES)))
        for i, b in enumerate(p_ids):
            for slot in range(p_bs):
                t = (p_first + i) * p_bs + slot
                for layer in range(LAYERS):
                    for plane in range(2):
                        for kv in range(2):
                            off = quant_row_at(b, p_bs, layer, plane, kv, slot)
                            src[off : off + (SCALES if plane else VALUES)] = quant_marker(
                                layer, plane, kv, t
                            )
        dst = bytearray(b"\xee" * (nblocks * LAYERS * 2 * d_bs * (VALUES + SCALES)))
        copies = plan_reblock(
            p_ids, p_bs, d_ids, d_bs, LAYERS, (VALUES, SCALES), first, end, p_first, d_first
        )
        for c in copies:
            dst[c.local_offset : c.local_offset + c.nbytes] = src[
                c.remote_offset : c.remote_offset + c.nbytes
            ]
        written = set()
        for t in range(first, end):
            b = d_ids[t // d_bs - d_first]
            for layer in range(LAYERS):
                for plane in range(2):
                    for kv in range(2):
                        off = quant_row_at(b, d_bs, layer, plane, kv, t % d_bs)
                        n = SCALES if plane else VALUES
                        assert dst[off : off + n] == quant_marker(layer, plane, kv, t), (
                            t,
                            layer,
                            plane,
                            kv,
                        )
                        written.update(range(off, off + n))
        whole = p_bs == d_bs and first % p_bs == 0
        block_bytes = LAYERS * 2 * d_bs * (VALUES + SCALES)
        stray = [i for i, x in enumerate(dst) if x != 0xEE and i not in written
                 and not (whole and i // block_bytes in d_ids)]
        assert not stray, f"bytes {stray[:4]} outside [{first}, {end}) were written"
        if not whole:
            assert sum(c.nbytes for c in copies) == (end - first) * LAYERS * 2 * (VALUES + SCALES)


# ------------------------------------------- a push across block sizes: one D (block, layer) unit
@pytest.mark.parametrize(("p_bs", "d_bs"), [(16, 32), (32, 16), (16, 48), (48, 32)])
@pytest.mark.parametrize("rows", [(ROW,), (VALUES, SCALES)])
def test_a_gathered_unit_is_the_reblock_copies_layer_page_of_that_d_block(p_bs, d_bs, rows):
    """Reference: plan_reblock moves the prompt from D's first block on into a D cache; every
    unit plan_unit_gather fills (from P's blocks starting at the one holding that D block's first
    token) equals that D block's layer page on the prompt's rows, and slots past the prompt's
    end stay untouched."""
    rng = random.Random(31 * p_bs + d_bs + len(rows))
    nblocks, page_d = 24, 2 * d_bs * sum(rows)
    for _ in range(6):
        end = rng.randint(1, 150)
        d_first = rng.randrange(-(-end // d_bs))
        first = d_first * d_bs
        p_first = first // p_bs
        p_ids = rng.sample(range(nblocks), -(-end // p_bs) - p_first)
        d_ids = rng.sample(range(nblocks), -(-end // d_bs) - d_first)
        src = bytearray(rng.randbytes(nblocks * LAYERS * 2 * p_bs * sum(rows)))
        dst = bytearray(b"\xee" * (nblocks * LAYERS * page_d))
        apply_any(plan_reblock(p_ids, p_bs, d_ids, d_bs, LAYERS, rows, first, end, p_first,
                               d_first), src, dst)
        for i, d in enumerate(d_ids):
            k = d_first + i
            for layer in range(LAYERS):
                unit = bytearray(b"\xee" * page_d)
                copies = plan_unit_gather(p_ids, p_first, p_bs, d_bs, k, layer, LAYERS, rows, end)
                apply_any(copies, src, unit)
                at = (d * LAYERS + layer) * page_d
                assert unit == dst[at : at + page_d], (k, layer, first, end)
                assert sum(c.nbytes for c in copies) == (min(end, (k + 1) * d_bs)
                                                         - k * d_bs) * 2 * sum(rows)


def apply_any(copies: list[Copy], src: bytearray, dst: bytearray) -> None:
    for c in copies:
        dst[c.local_offset : c.local_offset + c.nbytes] = src[
            c.remote_offset : c.remote_offset + c.nbytes
        ]


def test_a_unit_the_given_p_blocks_do_not_cover_or_past_the_prompt_is_refused():
    with pytest.raises(ValueError, match="cover"):  # D block 1 = tokens 32..63: P blocks 2, 3
        plan_unit_gather([4, 5], 0, 16, 32, 1, 0, LAYERS, (ROW,), 64)
    with pytest.raises(ValueError, match="no token"):
        plan_unit_gather([4, 5], 0, 16, 32, 1, 0, LAYERS, (ROW,), 32)
    with pytest.raises(ValueError, match="layer"):
        plan_unit_gather([4, 5], 0, 16, 32, 0, LAYERS, LAYERS, (ROW,), 32)
