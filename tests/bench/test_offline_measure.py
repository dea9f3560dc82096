"""`pdkv bench offline`'s decode time is split off inside one run (run seconds minus the seconds to
the first tokens), so a noisy prefill does not leak into decode tok/s: fakes with a known split."""

from __future__ import annotations

import pytest

from pdkv.bench.offline.measure import measure, throughputs


def test_decode_part_is_taken_inside_each_run_not_as_a_difference_of_runs():
    # Prefill varies wildly from run to run (4 s, then 9 s); decode is always 2 s for 7 tokens.
    prefill = iter([5.0, 4.0, 9.0, 6.0])
    calls = []

    def run(max_tokens):
        calls.append(max_tokens)
        pre = next(prefill)
        decode = 0.0 if max_tokens == 1 else 2.0
        return pre + decode, [[1] * max_tokens], pre

    pre, total, toks, extra = measure(run, output_len=8, repeats=2)
    assert calls == [1, 1, 8, 8] and extra == 0 and toks == [[1] * 8]
    assert pre == 4.0  # best 1-token run
    assert total == pytest.approx(4.0 + 2.0)  # best prefill + the decode part, not 8 s - 4 s
    row = throughputs(3, 128, 8, pre, total)
    assert row["decode_s"] == pytest.approx(2.0) and row["decode_tok_s"] == pytest.approx(
        3 * 7 / 2.0
    )


def test_a_zero_decode_part_is_measured_again():
    runs = iter([(1.0, [[0]], 1.0), (1.0, [[0, 0]], 1.0), (1.5, [[0, 0]], 1.0)])
    pre, total, _, extra = measure(lambda n: next(runs), output_len=2, repeats=1)
    assert extra == 1 and total - pre == pytest.approx(0.5)
