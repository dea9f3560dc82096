"""`pdkv bench offline --peer hf,llama.cpp`: the skip message, the GGUF converter's plumbing, the
workload table and its goals; with llama-cpp-python and the GGUF present, the peer's greedy tokens
against pdkv's."""

import argparse
import io
import os
import tarfile

import pytest

from pdkv.bench.llamacpp_gguf import convert, extract_converter, gguf_path
from pdkv.bench.offline import add_cli_args
from pdkv.bench.offline_llamacpp import unavailable_reason
from pdkv.bench.offline_report import format_workload_table, goal_for, workload_rows


def test_gguf_path_names_model_and_outtype(tmp_path):
    assert gguf_path("smollm2", "float32", str(tmp_path)) == str(tmp_path / "gguf" / "smollm2-f32.gguf")
    assert gguf_path("/m/SmolLM2-135M/", "bfloat16", str(tmp_path)).endswith("gguf/smollm2-135m-bf16.gguf")
    with pytest.raises(ValueError, match="float16"):
        gguf_path("smollm2", "float16", str(tmp_path))


def test_skip_message_names_the_make_target(tmp_path):
    cache = str(tmp_path)
    no_module = unavailable_reason("smollm2", "float32", cache, module_available=False)
    assert "llama-cpp-python" in no_module and "not installed" in no_module
    assert "`make llama-cpp`" in no_module
    missing = unavailable_reason("smollm2", "float32", cache, module_available=True)
    assert gguf_path("smollm2", "float32", cache) in missing and "`make llama-cpp`" in missing
    assert "float16" in unavailable_reason("smollm2", "float16", cache, module_available=True)
    os.makedirs(tmp_path / "gguf")
    open(gguf_path("smollm2", "float32", cache), "wb").close()
    assert unavailable_reason("smollm2", "float32", cache, module_available=True) is None
    # The BF16 file is separate.
    assert unavailable_reason("smollm2", "bfloat16", cache, module_available=True) is not None


def test_runner_skips_llamacpp_with_its_message(tmp_path, monkeypatch, capsys):
    from pdkv.bench import offline_runner

    monkeypatch.setenv("PDKV_CACHE", str(tmp_path))
    peer, reason = offline_runner._open_llamacpp("smollm2", "float32", 4, verbose=True)
    assert peer is None and reason.startswith("llama.cpp skipped:")
    assert reason in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown peers"):
        offline_runner.run_offline_bench(peers=["vllm"])


def _sdist(path, top="llama_cpp_python-9.9"):
    """A small stand-in sdist: a fake converter, its package, gguf-py and an unrelated file."""
    converter = (
        "import os, sys\n"
        "out = sys.argv[sys.argv.index('--outfile') + 1]\n"
        "typ = sys.argv[sys.argv.index('--outtype') + 1]\n"
        "assert os.environ['PYTHONPATH'].endswith('gguf-py')\n"
        "open(out, 'w').write(typ + ' ' + sys.argv[1])\n"
    )
    files = {
        "vendor/llama.cpp/convert_hf_to_gguf.py": converter,
        "vendor/llama.cpp/conversion/__init__.py": "",
        "vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
        "vendor/llama.cpp/ggml/src/big.c": "int x;",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_converter_is_unpacked_and_run_with_its_gguf_py(tmp_path):
    sdist = tmp_path / "s.tar.gz"
    _sdist(sdist)
    conv = extract_converter(str(sdist), str(tmp_path / "src"))
    assert os.path.isfile(os.path.join(conv, "convert_hf_to_gguf.py"))
    assert os.path.isdir(os.path.join(conv, "conversion")) and os.path.isdir(os.path.join(conv, "gguf-py"))
    assert not os.path.exists(os.path.join(conv, "ggml"))  # only the converter's parts
    out = str(tmp_path / "gguf" / "m-f32.gguf")
    convert(conv, "/models/m", "f32", out)
    with open(out) as f:
        assert f.read() == "f32 /models/m"
    assert not os.path.exists(out + ".tmp")
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.addfile(tarfile.TarInfo("x/README"), io.BytesIO(b""))
    with pytest.raises(FileNotFoundError, match="convert_hf_to_gguf.py"):
        extract_converter(str(bad), str(tmp_path / "src2"))


def test_peer_flag_parses():
    parser = add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args([]).peers == ["hf"]
    assert parser.parse_args(["--peer", "hf,llama.cpp"]).peers == ["hf", "llama.cpp"]
    assert parser.parse_args(["--peer", "none"]).peers == []
    assert parser.parse_args(["--long-prefill-len", "256"]).long_prefill_len == 256
    with pytest.raises(SystemExit):
        parser.parse_args(["--peer", "hf,vllm"])


def _sys(prefill, decode):
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}


def _entry(b, pdkv, hf, llamacpp, same):
    return {"batch_size": b, "pdkv": _sys(*pdkv), "hf": _sys(*hf), "llamacpp": _sys(*llamacpp),
            "greedy_match_requests_all": same}


def _result():
    e = _entry
    return {
        "dtype": "float32", "num_threads": 2, "input_len": 128, "llama_cpp_python_version": "0.3.36",
        "long_prefill": {"input_len": 512, "batch_size": 1, "pdkv": _sys(1200.0, None),
                         "hf": _sys(1000.0, None), "llamacpp": _sys(800.0, None),
                         "greedy_match_requests_all": 1},
        "results": [
            e(1, (700.0, 30.0), (400.0, 31.0), (600.0, 40.0), 1),
            e(8, (600.0, 160.0), (700.0, 120.0), (500.0, 150.0), 8),
            e(32, (1000.0, 600.0), (1100.0, 270.0), (600.0, 300.0), 31),
        ],
    }


def test_goals_are_the_issue_targets():
    assert goal_for("decode", 1, 128) == 1.0
    assert goal_for("decode", 32, 128) == 2.0 and goal_for("decode", 64, 128) == 2.5
    assert goal_for("decode", 8, 128) is None
    assert goal_for("long_prefill", 1, 512) == 1.5 and goal_for("long_prefill", 1, 256) is None


def test_workload_rows_ratios_goals_and_token_match():
    result = _result()
    rows = workload_rows(result)
    assert [r["workload"] for r in rows] == [
        "prefill 512, batch 1", "decode, batch 1", "decode, 8 sequences (aggregate)",
        "decode, 32 sequences (aggregate)", "prefill 8 x 128 in one step",
        "prefill 32 x 128 in one step",
    ]
    by = {r["workload"]: r for r in rows}
    assert by["prefill 512, batch 1"]["ratio"] == pytest.approx(1.5)
    assert by["prefill 512, batch 1"]["met"] is True  # 1.5 >= 1.5
    assert by["decode, batch 1"]["ratio"] == pytest.approx(0.75) and by["decode, batch 1"]["met"] is False
    assert by["decode, 32 sequences (aggregate)"]["ratio"] == pytest.approx(2.0)
    assert by["decode, 32 sequences (aggregate)"]["met"] is True
    assert by["decode, 8 sequences (aggregate)"]["goal"] is None
    assert by["decode, 8 sequences (aggregate)"]["met"] is None
    assert by["prefill 32 x 128 in one step"]["pdkv"] == 1000.0
    assert by["prefill 32 x 128 in one step"]["hf"] == 1100.0
    assert by["decode, 32 sequences (aggregate)"]["same_tokens"] == 31

    result["workloads"] = rows
    table = format_workload_table(result)
    assert "pdkv / llama.cpp" in table and "llama-cpp-python 0.3.36" in table
    lines = {ln.split("|")[0].strip(): ln for ln in table.splitlines() if "|" in ln}
    assert "0.75" in lines["decode, batch 1"] and "missed" in lines["decode, batch 1"]
    assert "met" in lines["prefill 512, batch 1"] and "31/32" in lines["decode, 32 sequences (aggregate)"]
    assert "greedy tokens identical on all systems: no" in table
    assert "goals (issue 14) met: 2/3" in table


def test_workload_table_says_yes_when_all_tokens_match_and_handles_missing_figures():
    result = _result()
    result["results"][2]["greedy_match_requests_all"] = 32
    result["results"][0]["llamacpp"]["decode_tok_s"] = None  # decode time lost in noise
    result["long_prefill"] = None
    result["workloads"] = workload_rows(result)
    table = format_workload_table(result)
    assert "greedy tokens identical on all systems: yes, every row" in table
    row = next(r for r in result["workloads"] if r["workload"] == "decode, batch 1")
    assert row["ratio"] is None and row["met"] is None
    assert "goals (issue 14) met: 1/1" in table  # only the 32-sequence goal was measurable


@pytest.mark.slow
def test_llamacpp_peer_greedy_tokens_equal_pdkv(parity_prompts, parity_reference_24):
    """Two sequences in one llama.cpp context (one llama_decode per step) give pdkv's tokens."""
    pytest.importorskip("llama_cpp")
    path = gguf_path("smollm2", "float32")
    if not os.path.isfile(path):
        pytest.skip(f"{path} missing (`make llama-cpp`)")
    from pdkv.bench.offline_llamacpp import LlamaCppPeer

    n = 6
    prompts = parity_prompts[:2]
    with LlamaCppPeer(path, "float32", n_threads=1, output_len=n) as peer:
        seconds, toks = peer.run(prompts, n)
        assert seconds > 0 and [len(t) for t in toks] == [n, n]
        for got, ref in zip(toks, parity_reference_24, strict=False):
            want = list(ref.outputs[0].token_ids)[:n]
            assert got[:len(want)] == want
        _, again = peer.run(prompts[:1], 2)  # a new context shape; the cache starts empty
        assert again[0] == toks[0][:2]
        with pytest.raises(ValueError):
            peer.run(prompts, n + 1)
