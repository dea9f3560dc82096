"""`python -m pdkv.bench.model.weight_stream`: both placements of a model's packed weights are
measured over the same bytes, the arena's is advised where the kernel allows huge pages, and the
printed table carries the machine lines."""

from __future__ import annotations

import re

import pytest

from pdkv.bench.model import weight_stream
from pdkv.model.hugepages import thp_mode
from pdkv.model.panel_linear import panel_linear_unavailable


def test_both_placements_stream_the_same_weights(tiny_llama_kv2, capsys):
    import torch

    if panel_linear_unavailable(torch.zeros(16, 16)) is not None:
        pytest.skip("the panel kernel cannot run here")
    rows = weight_stream.measure(tiny_llama_kv2, repeats=1)
    assert [r["placement"].split(" (")[0] for r in rows] == ["4 KiB pages", "2 MiB pages"]
    # the same packed bytes on both placements
    assert rows[0]["weights_mb"] == rows[1]["weights_mb"] > 0
    for r in rows:
        assert r["linears_ms"] > 0 and r["linears_gb_s"] > 0 and r["sum_gb_s"] > 0
    advised = rows[1]["placement"].endswith("(advised)")
    assert advised == (thp_mode() in ("always", "madvise"))
    assert weight_stream.main(["--model", tiny_llama_kv2, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cpu: .*, flags .*, \d+ cores$", out, re.M)
    assert "| 4 KiB pages |" in out and "| 2 MiB pages (arena)" in out
