"""pdkv's C++ ops compile for every x86 ISA ATen's CPU dispatch knows (syntax only, so any x86 box
checks all four: pdkv/model/csrc_isa.py), the check catches a source that only one ISA rejects,
and `make setup`'s build step fails loudly on a compiler error but not without a compiler."""

from __future__ import annotations

import subprocess

import pytest
from system_packages import require

from pdkv.model import csrc_isa, paged_decode_build
from pdkv.model.paged_decode_build import SOURCES, first_compiler_error

# What csrc/ held before csrc/cpu_vec.h: CPU_CAPABILITY set by hand, then only ATen's vec.h. On
# AVX2 vec256's headers happen to bring vec_reduce_all's Vectorized overload; vec512's do not.
VEC512_ONLY_BREAK = """
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#include <ATen/cpu/vec/vec.h>
using Vec = at::vec::Vectorized<float>;
float sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}
"""


@pytest.fixture(scope="module")
def compiler_present() -> None:
    require("g++", "python3-dev")


def test_every_op_compiles_for_every_isa(compiler_present):
    results = csrc_isa.check()
    assert {(r.source, r.march) for r in results} == {
        (s.name, m)
        for s in SOURCES
        for m in ("x86-64-v2", "x86-64-v3", "x86-64-v4", "sapphirerapids")
    }
    failed = [f"{r.source} -march={r.march}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)


def test_the_check_catches_a_source_only_avx512_rejects(compiler_present, tmp_path):
    src = tmp_path / "reduce.cpp"
    src.write_text(VEC512_ONLY_BREAK)
    by_march = {r.march: r for r in csrc_isa.check((src,), ("x86-64-v3", "x86-64-v4"))}
    assert by_march["x86-64-v3"].ok, by_march["x86-64-v3"].error
    assert not by_march["x86-64-v4"].ok
    assert "vec_reduce_all" in (by_march["x86-64-v4"].error or "")
    # the same inputs again: the cached verdict, failures included
    again = csrc_isa.check((src,), ("x86-64-v4",))[0]
    assert again.cached and not again.ok and again.error == by_march["x86-64-v4"].error


def test_cli_exit_status_follows_the_results(compiler_present, tmp_path, capsys):
    good, bad = tmp_path / "good.cpp", tmp_path / "bad.cpp"
    good.write_text("int f() { return 1; }\n")
    bad.write_text("int f() { return undeclared; }\n")
    assert csrc_isa.main([str(good), "--march", "x86-64-v2"]) == 0
    assert csrc_isa.main([str(good), str(bad), "--march", "x86-64-v2"]) == 1
    out = capsys.readouterr().out
    assert "bad.cpp" in out and "FAILED" in out and "undeclared" in out


def test_first_compiler_error_is_the_first_error_line(compiler_present, tmp_path):
    src = tmp_path / "two.cpp"
    src.write_text("int a() { return x1; }\nint b() { return x2; }\n")
    out = subprocess.run(["c++", "-fsyntax-only", str(src)], capture_output=True, text=True).stderr
    first = first_compiler_error(out)
    assert first is not None and "x1" in first and "x2" not in first
    assert first_compiler_error("ninja: build stopped: subcommand failed.") is None


def test_setup_build_fails_on_a_compiler_error(monkeypatch, capsys, tmp_path):
    """`make setup` runs this main: a compiler error is exit status 1 with the error printed."""
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path))
    monkeypatch.setattr(paged_decode_build, "compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(
        paged_decode_build,
        "build",
        lambda paths, force=False: "build failed: fused_ops.cpp:52:40: error: no matching function",
    )
    assert paged_decode_build.main([]) == 1
    err = capsys.readouterr().err
    assert "fused_ops.cpp:52:40: error: no matching function" in err and "ATen vector ISA" in err


def test_setup_without_a_compiler_warns_once_and_succeeds(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built without a compiler")

    monkeypatch.setattr(paged_decode_build, "build", no_build)
    assert paged_decode_build.main([]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no C++ compiler" in err[0] and "torch paths" in err[0]


def test_cpu_ops_switch_hides_a_loaded_extension(cpu_ops, monkeypatch):
    from pdkv.model.paged_decode import resolve_attention_backend

    assert paged_decode_build.load() is None
    monkeypatch.setenv("PDKV_CPU_OPS", "0")
    assert paged_decode_build.load() == "hidden by PDKV_CPU_OPS=0"
    assert resolve_attention_backend("auto", "cpu") == "torch"
