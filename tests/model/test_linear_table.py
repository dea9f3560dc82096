"""The torch-free halves of `--cpu-linear auto` and the bf16 CPU check: bucket lookup and table
choice (pdkv/model/linear_table.py), /proc/cpuinfo flags (pdkv/model/cpu_features.py)."""

from __future__ import annotations

import pytest

from pdkv.model.cpu_features import CpuFeatures, dtype_warning, parse_cpuinfo
from pdkv.model.linear_table import LinearTable, build_table


def test_tokens_go_to_the_nearest_bucket_on_a_log_scale():
    t = LinearTable((1, 8, 32, 64, 512), ("a", "b", "c", "d", "e"))
    # boundaries: sqrt(8) = 2.83, 16, 45.3, 181
    expect = {
        1: 0,
        2: 0,
        3: 1,
        8: 1,
        15: 1,
        16: 2,
        32: 2,
        45: 2,
        46: 3,
        181: 3,
        182: 4,
        512: 4,
        100000: 4,
    }
    assert {n: t.bucket_index(n) for n in expect} == expect
    assert t.backend_for(1) == "a" and t.backend_for(5) == "b" and t.backend_for(4096) == "e"
    assert t.describe() == "1:a 8:b 32:c 64:d 512:e"
    one = LinearTable((8,), ("x",))
    assert one.backend_for(1) == one.backend_for(10**6) == "x"


@pytest.mark.parametrize(("buckets", "backends"), [((), ()), ((1, 8), ("a",)), ((8, 8), ("a", "b")),
                                                   ((8, 1), ("a", "b")), ((0, 8), ("a", "b"))])
def test_malformed_tables_are_refused(buckets, backends):
    with pytest.raises(ValueError):
        LinearTable(buckets, backends)


def test_build_table_keeps_the_fastest_measured_backend_per_bucket():
    timings = {
        64: {"torch": 3.0, "onednn": 2.0},
        1: {"torch": 1.0, "onednn": 2.0},
        512: {"upcast": 5.0},  # the others were not timed there
        8: {"torch": 1.0, "onednn": 1.0},  # exact tie: the preference order decides
    }
    t = build_table(timings, order=("onednn", "torch"))
    assert t.buckets == (1, 8, 64, 512)
    assert t.backends == ("torch", "onednn", "onednn", "upcast")
    assert build_table({8: {"torch": 1.0, "onednn": 1.0}}).backends == (
        "onednn",
    )  # no order: by name
    with pytest.raises(ValueError):
        build_table({})
    with pytest.raises(ValueError):
        build_table({1: {}})


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl avx512dq {extra}
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu
"""


def test_bf16_flags_from_cpuinfo():
    spr = parse_cpuinfo(CPUINFO.format(extra="avx512_bf16 amx_bf16 amx_tile"))
    assert spr.native_bf16 and spr.onednn_bf16
    assert spr.describe() == "amx_bf16 amx_tile avx512_bf16 avx512f avx2"
    skx = parse_cpuinfo(CPUINFO.format(extra=""))  # AVX-512 without BF16: oneDNN converts
    assert not skx.native_bf16 and skx.onednn_bf16
    zen2 = parse_cpuinfo("flags : fpu sse2 avx2 fma\n")
    assert not zen2.native_bf16 and not zen2.onednn_bf16 and zen2.describe() == "avx2"
    assert parse_cpuinfo("no flags here").flags == frozenset()
    assert parse_cpuinfo("Features : fp asimd bf16\n").flags == {
        "fp",
        "asimd",
        "bf16",
    }  # aarch64's key


def test_bf16_is_allowed_everywhere_and_warned_about_without_native_support():
    native = CpuFeatures(frozenset({"avx512_bf16"}))
    plain = CpuFeatures(frozenset({"avx2"}))
    assert dtype_warning("bfloat16", "cpu", native) is None
    assert dtype_warning("float32", "cpu", plain) is None
    assert dtype_warning("bfloat16", "cuda:0", plain) is None
    msg = dtype_warning("bfloat16", "cpu", plain)
    assert msg is not None and "avx512_bf16" in msg and "avx2" in msg
    assert dtype_warning("float16", "cpu", native) is not None  # no native fp16 GEMM either
