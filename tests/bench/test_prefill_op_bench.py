"""`python -m pdkv.bench.model.prefill_op`: its FLOP count against a brute-force count of the
attended keys, and a tiny run printing one row per case."""

from __future__ import annotations

from pdkv.bench.model import prefill_op


def test_attention_flop_counts_every_attended_key():
    for new, cached, heads, d in [(1, 0, 1, 1), (5, 3, 2, 8), (16, 0, 9, 64), (7, 100, 3, 10)]:
        keys = sum(cached + i + 1 for i in range(new))  # query i sees cached + i + 1 keys
        assert prefill_op.attention_flop(new, cached, heads, d) == 4 * heads * keys * d


def test_tiny_run_prints_a_row_per_case(cpu_ops, capsys):
    assert prefill_op.main(["--new-tokens", "8", "--cached", "0,20", "--num-heads", "4",
                            "--num-kv-heads", "2", "--head-size", "16", "--repeats", "2",
                            "--num-threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["0", "20"]
    assert all(float(r.split("|")[3]) > 0 for r in rows)
