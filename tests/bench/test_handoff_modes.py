"""`pdkv bench handoff --transfer-modes`'s arithmetic (pdkv/bench/handoff/modes.py): the exposed
transfer and the push / pull ratios of its table. No process started."""

from __future__ import annotations

import pytest

from pdkv.bench.handoff.modes import ModeRow, format_rows, run_modes_bench


def test_exposed_transfer_and_the_ratios_on_the_push_line():
    pull = ModeRow("pull", 2048, ttft_s=6.0, prefill_s=4.0, d_first_step_s=0.5, transfer_s=1.4,
                   nbytes=94e6)
    push = ModeRow("push", 2048, ttft_s=4.9, prefill_s=4.2, d_first_step_s=0.5, transfer_s=4.3,
                   nbytes=94e6)
    assert pull.exposed_s == pytest.approx(1.5) and push.exposed_s == pytest.approx(0.2)
    # a push faster than P's own timing of its leg is no negative exposure
    assert ModeRow("push", 16, 1.0, 1.2, 0.1, 0.0, 0.0).exposed_s == 0.0
    slow = ModeRow("pull", 2048, ttft_s=9.0, prefill_s=6.0, d_first_step_s=0.5, transfer_s=2.4,
                   nbytes=94e6)
    table = format_rows([pull, slow, pull, push]).splitlines()
    assert table[2] == "| 2048 | pull | 6000 | 4000 | 500 | 1500 | 94.0 |"
    # medians of each mode (pull: 6.0 s of 6.0, 9.0, 6.0; exposed 1.5), then the ratios
    assert table[-1] == "| 2048 | 1 | 6000 / 4900 | 0.82 | 1500 / 200 | 0.13 |"


def test_bad_modes_and_repeats_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="transfer modes"):
        run_modes_bench(["shove"], print_table=False)
    with pytest.raises(ValueError, match="repeats"):
        run_modes_bench(["pull"], repeats=0, print_table=False)
