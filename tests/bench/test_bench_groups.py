"""`pdkv bench groups` (issue 11, acceptance 4): the per-group block formula against a brute-force
count, the real-size rows against hand-computed figures, the peer ratios, and one small real
run on tiny-swa whose measured bytes equal the formula."""

from __future__ import annotations

import pytest

from pdkv.bench.groups.report import add_peer_ratios, blocks_moved, format_real_size, real_size_rows


def brute_force_blocks(n: int, bs: int, window: int | None) -> int:
    """Blocks holding a token that query n - 1 reads, or that a prefix hit of the last block
    boundary B <= n - 1 needs (B - W + 1 .. B - 1); every block without a window."""
    if window is None:
        return -(-n // bs)
    boundary = (n - 1) // bs * bs
    needed = set(range(max(0, n - window), n)) | set(range(max(0, boundary - window + 1), boundary))
    return len({t // bs for t in needed} | {(n - 1) // bs})


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
def test_blocks_moved_equals_brute_force_and_is_bounded_by_the_window(bs, window):
    for n in range(1, 150):
        assert blocks_moved(n, bs, window) == brute_force_blocks(n, bs, window), (n, bs, window)
        if window is not None:
            assert blocks_moved(n, bs, window) <= -(-(window - 1) // bs) + 1
    with pytest.raises(ValueError, match="must be >= 1"):
        blocks_moved(0, bs, window)


@pytest.mark.parametrize("bs", [1, 4, 8, 16])
@pytest.mark.parametrize("window", [None, 5, 16, 24, 40])
def test_blocks_moved_when_d_resumes_after_the_prompt(bs, window):
    """A model with a state-slot group (linear state, DeepSeek-V4's compressor state): D resumes
    at n, so a window group keeps what query n reads (n - W + 1 .. n - 1) and what a hit of the
    block boundary B <= n needs (B - W + 1 .. B - 1), and the block of token n - 1."""
    for n in range(1, 150):
        if window is None:
            want = -(-n // bs)
        else:
            boundary = n // bs * bs
            needed = set(range(max(0, n - window + 1), n))
            needed |= set(range(max(0, boundary - window + 1), boundary))
            want = len({t // bs for t in needed} | {(n - 1) // bs})
        assert blocks_moved(n, bs, window, resume_at_end=True) == want, (n, bs, window)


def test_real_size_rows_match_hand_computed_figures():
    rows = real_size_rows(("gemma-3-27b", "qwen3-next-80b-a3b"), (1024, 4096))
    by = {(r["model"], r["kind"]): r for r in rows}
    full, swa = by["gemma-3-27b", "full_attention"], by["gemma-3-27b", "sliding_window"]
    assert (full["layers"], swa["layers"]) == (10, 52)  # 5 local layers per global one, 62 layers
    assert (
        full["bytes_per_token"] == 2 * 10 * 16 * 128 * 2
    )  # K/V x layers x KV heads x head dim x bf16
    assert (
        swa["held"]["4096"] == swa["held"]["1024"] == 1024 * 2 * 52 * 16 * 128 * 2
    )  # the window only
    assert full["held"]["4096"] == 4 * full["held"]["1024"]
    lin = by["qwen3-next-80b-a3b", "linear_state"]
    assert (
        lin["bytes_per_token"] == 0
        and lin["held"]["1024"] == lin["held"]["4096"] == lin["bytes_per_request"] > 0
    )
    table = format_real_size(rows, (1024, 4096))
    assert "gemma-3-27b" in table and "total" in table


def test_peer_ratios_compare_rows_of_the_same_length():
    rows = [{"model": "a", "prompt_tokens": 8, "bytes_received": 50, "transfer_s": 2.0},
            {"model": "peer", "prompt_tokens": 8, "bytes_received": 100, "transfer_s": 4.0},
            {"model": "a", "prompt_tokens": 9, "bytes_received": 7, "transfer_s": 1.0}]
    add_peer_ratios(rows, "peer")
    assert (rows[0]["bytes_ratio"], rows[0]["time_ratio"]) == (0.5, 0.5)
    assert "bytes_ratio" not in rows[2]
    from pdkv.bench.groups.report import format_measured

    for r in rows:
        r.update(groups=[], formula_bytes=r["bytes_received"])
    lines = format_measured(rows).splitlines()
    assert lines[1].split()[-3:] == ["0.500", "0.50", "ok"]
    assert lines[3].split()[-3:] == ["-", "-", "ok"]  # no peer row: no ratio printed


@pytest.mark.slow
def test_tiny_swa_pull_moves_the_formula_bytes(tiny_swa):
    from pdkv.bench.groups.cli import run_model

    (row,) = run_model(tiny_swa, [150], repeats=1, transfer="tcp", seed=0, num_threads=1)
    kinds = {g["kind"]: g for g in row["groups"]}
    assert kinds["full_attention"]["blocks"] == 10 and kinds["sliding_window"]["blocks"] == 4
    assert (
        row["bytes_received"] == row["formula_bytes"] == 14 * kinds["full_attention"]["block_bytes"]
    )


def test_blocks_moved_of_a_linear_state_group_is_one_slot():
    assert [blocks_moved(n, 16, None, per_request=True) for n in (1, 16, 150, 4096)] == [1, 1, 1, 1]


@pytest.mark.slow
def test_tiny_gdn_pull_moves_the_blocks_and_one_slot(tiny_gdn):
    from pdkv.bench.groups.cli import run_model

    (row,) = run_model(tiny_gdn, [150], repeats=1, transfer="tcp", seed=0, num_threads=1)
    kinds = {g["kind"]: g for g in row["groups"]}
    assert kinds["full_attention"]["blocks"] == 10 and kinds["linear_state"]["blocks"] == 1
    assert kinds["linear_state"]["bytes_per_token"] == 0
    assert row["bytes_received"] == row["formula_bytes"] == (
        10 * kinds["full_attention"]["block_bytes"] + kinds["linear_state"]["block_bytes"])
