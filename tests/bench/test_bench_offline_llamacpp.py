"""`pdkv bench offline --peer hf,llama.cpp`: the skip message, the GGUF converter's plumbing, the
workload table and its goals; with llama-cpp-python and the GGUF present, the peer's greedy tokens
against pdkv's."""

import argparse
import ctypes
import io
import os
import sys
import tarfile
import types

import numpy as np
import pytest

from pdkv.bench.offline.cli import add_cli_args
from pdkv.bench.offline.limits import MachineLimits, ModelCost, limits_dict
from pdkv.bench.offline.llamacpp import unavailable_reason
from pdkv.bench.offline.llamacpp_gguf import convert, extract_converter, gguf_path
from pdkv.bench.offline.report import format_workload_table
from pdkv.bench.offline.workloads import (
    BF16_GOALS,
    GOALS,
    Goal,
    evaluate_goals,
    goals_for,
    workload_rows,
)


def test_gguf_path_names_model_and_outtype(tmp_path):
    assert gguf_path("smollm2", "float32", str(tmp_path)) == str(
        tmp_path / "gguf" / "smollm2-f32.gguf"
    )
    assert gguf_path("/m/SmolLM2-135M/", "bfloat16", str(tmp_path)).endswith(
        "gguf/smollm2-135m-bf16.gguf"
    )
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
    from pdkv.bench.offline import runner as offline_runner

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
    assert os.path.isdir(os.path.join(conv, "conversion")) and os.path.isdir(
        os.path.join(conv, "gguf-py")
    )
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
        "dtype": "float32",
        "num_threads": 2,
        "input_len": 128,
        "llama_cpp_python_version": "0.3.36",
        "long_prefill": {
            "input_len": 512,
            "batch_size": 1,
            "pdkv": _sys(1200.0, None),
            "hf": _sys(1000.0, None),
            "llamacpp": _sys(800.0, None),
            "greedy_match_requests_all": 1,
        },
        "results": [
            e(1, (700.0, 30.0), (400.0, 31.0), (600.0, 40.0), 1),
            e(8, (600.0, 160.0), (700.0, 120.0), (500.0, 150.0), 8),
            e(32, (1000.0, 600.0), (1100.0, 270.0), (600.0, 300.0), 31),
        ],
    }


def test_goals_are_the_speed_targets():
    by = {(g.key, g.measure): (g.goal, g.floor) for g in GOALS}
    assert by[(("decode", 1), "vs_llamacpp")] == (1.05, 0.95)
    assert by[(("decode", 1), "of_limit")] == (0.88, 0.80)
    assert by[(("decode", 32), "vs_llamacpp")] == (1.5, 1.2)
    assert by[(("decode", 64), "vs_llamacpp")] == (1.5, 1.2)
    assert by[(("decode", 64), "of_fma_peak")] == (0.50, None)
    assert by[(("long_prefill", 512), "vs_llamacpp")] == (1.5, 1.3)
    assert by[(("prefill_batch", 64), "vs_hf")] == (1.0, 0.9)


# 100 M matmul params, 400 MB of weights; 20 GB/s and 100 GFLOP/s: batch-1 decode is bandwidth
# bound at 50 tok/s (20 ms per step), compute caps every batch at 500 tok/s (0.2 GFLOP/token).
COST = ModelCost(weight_bytes=400_000_000, matmul_params=100_000_000, dtype="float32")
LIMITS = MachineLimits(read_bytes_per_s=20e9, read_buffer_bytes=400_000_000,
                       matmul_flop_per_s=100e9, matmul_n=1024, threads=2)


def test_workload_rows_ratios_limits_and_token_match():
    result = _result()
    rows = workload_rows(result, COST, LIMITS)
    assert [r["workload"] for r in rows] == [
        "prefill 512, batch 1", "decode, batch 1", "decode, 8 sequences (aggregate)",
        "decode, 32 sequences (aggregate)", "prefill 8 x 128 in one step",
        "prefill 32 x 128 in one step",
    ]
    by = {r["workload"]: r for r in rows}
    assert by["prefill 512, batch 1"]["ratio"] == pytest.approx(1.5)
    assert by["decode, batch 1"]["ratio"] == pytest.approx(0.75)
    assert by["decode, batch 1"]["limit"] == pytest.approx(50.0)
    assert by["decode, batch 1"]["pdkv_of_limit"] == pytest.approx(30.0 / 50.0)
    assert by["decode, batch 1"]["llamacpp_of_limit"] == pytest.approx(40.0 / 50.0)
    # 8 sequences: max(20 ms of reads, 8 x 2 ms of FLOP) -> 400 tok/s; 32: compute bound, 500.
    assert by["decode, 8 sequences (aggregate)"]["limit"] == pytest.approx(400.0)
    assert by["decode, 32 sequences (aggregate)"]["limit"] == pytest.approx(500.0)
    assert by["prefill 32 x 128 in one step"]["limit"] == pytest.approx(500.0)
    assert by["prefill 32 x 128 in one step"]["hf_ratio"] == pytest.approx(1000.0 / 1100.0)
    assert by["decode, 32 sequences (aggregate)"]["ratio"] == pytest.approx(2.0)
    assert by["decode, 32 sequences (aggregate)"]["same_tokens"] == 31
    # Without limits the rows still compare the systems.
    assert workload_rows(result)[1]["limit"] is None


def test_goals_are_judged_with_their_floors():
    result = _result()
    result["results"].append(_entry(64, (400.0, 200.0), (500.0, 90.0), (300.0, 150.0), 64))
    rows = workload_rows(result, COST, LIMITS)
    goals = evaluate_goals(rows, COST, LIMITS)
    by = {(g["workload"], g["measure"]): g for g in goals}
    b1 = by[("decode, batch 1", "vs_llamacpp")]  # 0.75: misses the goal and breaks the floor
    assert b1["value"] == pytest.approx(0.75) and b1["met"] is False and b1["floor_held"] is False
    lim = by[("decode, batch 1", "of_limit")]  # 60 % of the read limit
    assert lim["value"] == pytest.approx(0.6) and lim["floor_held"] is False
    b64 = by[("decode, 64 sequences (aggregate)", "vs_llamacpp")]  # 200 / 150
    assert b64["value"] == pytest.approx(4 / 3) and b64["met"] is False and b64["floor_held"]
    peak = by[("decode, 64 sequences (aggregate)", "of_fma_peak")]  # 200 x 0.2 GFLOP / 100
    assert peak["value"] == pytest.approx(0.4) and peak["met"] is False
    assert peak["floor_held"] is None
    pre = by[("prefill 64 x 128 in one step", "vs_hf")]
    assert pre["value"] == pytest.approx(0.8) and pre["floor_held"] is False
    assert by[("prefill 512, batch 1", "vs_llamacpp")]["met"] is True
    # The 32-sequence goal: 600 / 300.
    assert by[("decode, 32 sequences (aggregate)", "vs_llamacpp")]["met"] is True
    # A goal on a row that was not run is left out; an unknown measure is an error.
    assert len(goals) == len(GOALS)
    assert evaluate_goals(rows[:1], COST, LIMITS) == [
        g for g in goals if g["workload"] == "prefill 512, batch 1"
    ]
    with pytest.raises(ValueError, match="unknown goal measure"):
        evaluate_goals(rows, goals=(Goal(("decode", 1), "vs_vllm", 1.0, None),))

    result["workloads"] = rows
    result["limits"] = limits_dict(COST, LIMITS)
    result["goals"] = goals
    result["host_cpu"] = "AMD EPYC (fma, avx2)"
    table = format_workload_table(result)
    assert "pdkv / llama.cpp" in table and "llama-cpp-python 0.3.36" in table
    assert "cpu: AMD EPYC (fma, avx2)" in table
    assert "limit: memory read 20.0 GB/s" in table and "batch-1 decode <= 50.0 tok/s" in table
    assert "fp32 matmul 100.0 GFLOP/s" in table and "FMA peak not measured" in table
    workload_part, goals_part = table.split("greedy tokens identical")
    lines = {ln.split("|")[0].strip(): ln for ln in workload_part.splitlines() if "|" in ln}
    assert "0.75" in lines["decode, batch 1"] and "60 %" in lines["decode, batch 1"]
    goal_lines = [ln for ln in goals_part.splitlines() if ln.startswith("decode, batch 1")]
    assert any("pdkv / roofline" in ln and "60 %" in ln and "BROKEN" in ln for ln in goal_lines)
    assert "31/32" in lines["decode, 32 sequences (aggregate)"]
    assert "greedy tokens identical on all systems: no" in table
    assert "goals met: 2/7; floors held: 3/6" in table
    assert "BROKEN" in table


def test_same_tokens_is_not_claimed_when_pdkv_ran_alone():
    from pdkv.bench.offline.runner import _compare

    entry: dict = {"pdkv": {"prefill_tok_s": 1.0, "decode_tok_s": 1.0}}
    _compare(entry, 2, {"pdkv": [[1, 2], [3, 4]]})
    assert entry["greedy_match_requests_all"] is None
    both: dict = {"pdkv": {"prefill_tok_s": 1.0, "decode_tok_s": 1.0},
                  "hf": {"prefill_tok_s": 1.0, "decode_tok_s": 1.0}}
    _compare(both, 2, {"pdkv": [[1, 2], [3, 4]], "hf": [[1, 2], [3, 5]]})
    assert both["greedy_match_requests_all"] == 1 and both["greedy_match_requests"] == 1
    result = _result()
    for e in result["results"]:
        e["greedy_match_requests_all"] = None
    result["long_prefill"] = None
    result["workloads"] = workload_rows(result)
    table = format_workload_table(result)
    assert "greedy tokens identical on all systems: n/a (no peer ran)" in table
    assert "| n/a" in table or " n/a" in table


def test_a_bfloat16_run_is_judged_by_the_bfloat16_goals():
    # `--dtype bfloat16`: batch-1 decode against llama.cpp's BF16 GGUF (aimed at 1.3x, no
    # floor), not the float32 goals; the table says which dtype its goals are of.
    assert goals_for("bfloat16") == BF16_GOALS and goals_for("float32") == GOALS
    result = _result()
    result["dtype"] = "bfloat16"
    rows = workload_rows(result, COST, LIMITS)
    (b1,) = evaluate_goals(rows, COST, LIMITS, goals_for("bfloat16"))
    assert (b1["workload"], b1["measure"]) == ("decode, batch 1", "vs_llamacpp")
    assert b1["value"] == pytest.approx(0.75) and b1["met"] is False and b1["floor_held"] is None
    result.update(workloads=rows, limits=limits_dict(COST, LIMITS), goals=[b1])
    table = format_workload_table(result)
    assert "goal (bfloat16)" in table and "goal (float32)" not in table
    assert "goals met: 0/1; floors held: 0/0" in table


def test_workload_table_says_yes_when_all_tokens_match_and_handles_missing_figures():
    result = _result()
    result["results"][2]["greedy_match_requests_all"] = 32
    result["results"][0]["llamacpp"]["decode_tok_s"] = None  # decode time lost in noise
    result["long_prefill"] = None
    result["workloads"] = workload_rows(result)
    result["goals"] = evaluate_goals(result["workloads"])
    table = format_workload_table(result)
    assert "greedy tokens identical on all systems: yes, every row" in table
    row = next(r for r in result["workloads"] if r["workload"] == "decode, batch 1")
    assert row["ratio"] is None and row["limit"] is None
    # Only the 32-sequence goal is measurable: batch 1 lost llama.cpp's figure and has no limits.
    assert "goals met: 1/1; floors held: 1/1 (2 not measurable in this run)" in table


def test_per_batch_table_carries_the_skip_message():
    from pdkv.bench.offline.report import format_table

    result = {
        "model": "smollm2",
        "dtype": "float32",
        "device": "cpu",
        "num_threads": 2,
        "input_len": 8,
        "output_len": 2,
        "torch_version": "t",
        "transformers_version": "x",
        "repeats": 1,
        "greedy_match": None,
        "results": [
            {
                "batch_size": 1,
                "pdkv": _sys(10.0, 2.0),
                "hf": None,
                "prefill_ratio": None,
                "decode_ratio": None,
            }
        ],
        "llamacpp_skipped": "llama.cpp skipped: GGUF /x missing; `make llama-cpp` converts it",
    }
    assert format_table(result).endswith(result["llamacpp_skipped"])


@pytest.mark.slow
def test_llamacpp_peer_greedy_tokens_equal_pdkv(parity_prompts, parity_reference_24):
    """Two sequences in one llama.cpp context (one llama_decode per step) give pdkv's tokens."""
    pytest.importorskip("llama_cpp")
    path = gguf_path("smollm2", "float32")
    if not os.path.isfile(path):
        pytest.skip(f"{path} missing (`make llama-cpp`)")
    from pdkv.bench.offline.llamacpp import LlamaCppPeer

    n = 6
    prompts = parity_prompts[:2]
    with LlamaCppPeer(path, "float32", n_threads=1, output_len=n) as peer:
        seconds, toks, first = peer.run(prompts, n)
        assert seconds > first > 0 and [len(t) for t in toks] == [n, n]
        for got, ref in zip(toks, parity_reference_24, strict=False):
            want = list(ref.outputs[0].token_ids)[:n]
            assert got[:len(want)] == want
        again = peer.run(prompts[:1], 2)[1]  # a new context shape; the cache starts empty
        assert again[0] == toks[0][:2]
        with pytest.raises(ValueError):
            peer.run(prompts, n + 1)


class _FakeLlamaCpp:
    """Stands in for the `llama_cpp` binding: real ctypes batches, a toy model whose next token
    is (sum of the sequence's tokens) % vocab, a KV cache per context that checks positions and
    sequence ids, and a record of every llama_decode."""

    llama_log_callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)

    def __init__(self, vocab=50):
        self.vocab = vocab
        self.decodes = []  # (n_tokens, [(token, pos, seq, output)]) per llama_decode
        self.contexts = []

    def llama_backend_init(self):
        pass

    def llama_log_set(self, cb, user):
        self.log_cb = cb

    def llama_model_default_params(self):
        return None

    def llama_model_load_from_file(self, path, params):
        return object()

    def llama_model_get_vocab(self, model):
        return object()

    def llama_vocab_n_tokens(self, vocab):
        return self.vocab

    def llama_context_default_params(self):
        return types.SimpleNamespace()

    def llama_init_from_model(self, model, p):
        ctx = types.SimpleNamespace(params=p, kv={}, logits=None, out_row={})
        self.contexts.append(ctx)
        return ctx

    def llama_get_memory(self, ctx):
        return ctx

    def llama_memory_clear(self, mem, data):
        mem.kv.clear()

    def llama_batch_init(self, n, embd, n_seq_max):
        ids = [(ctypes.c_int32 * n_seq_max)() for _ in range(n)]
        seq = (ctypes.POINTER(ctypes.c_int32) * n)(
            *[ctypes.cast(a, ctypes.POINTER(ctypes.c_int32)) for a in ids]
        )
        b = types.SimpleNamespace(
            n_tokens=0, capacity=n, keep=ids,
            token=ctypes.cast((ctypes.c_int32 * n)(), ctypes.POINTER(ctypes.c_int32)),
            pos=ctypes.cast((ctypes.c_int32 * n)(), ctypes.POINTER(ctypes.c_int32)),
            n_seq_id=ctypes.cast((ctypes.c_int32 * n)(), ctypes.POINTER(ctypes.c_int32)),
            logits=ctypes.cast((ctypes.c_int8 * n)(), ctypes.POINTER(ctypes.c_int8)),
        )
        b.seq_id = ctypes.cast(seq, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        b.keep_seq = seq
        return b

    def llama_decode(self, ctx, b):
        p = ctx.params
        assert b.n_tokens <= min(b.capacity, p.n_batch, p.n_ubatch)
        rows = [
            (b.token[i], b.pos[i], b.seq_id[i][0], bool(b.logits[i])) for i in range(b.n_tokens)
        ]
        assert all(b.n_seq_id[i] == 1 for i in range(b.n_tokens))
        self.decodes.append((b.n_tokens, rows))
        outs = []
        for i, (tok, pos, seq, out) in enumerate(rows):
            assert 0 <= seq < p.n_seq_max
            cache = ctx.kv.setdefault(seq, [])
            assert pos == len(cache) < p.n_ctx // p.n_seq_max  # contiguous, within its share
            cache.append(tok)
            if out:
                outs.append((i, sum(cache) % self.vocab))
        ctx.logits = np.zeros((len(outs), self.vocab), dtype=np.float32)
        ctx.out_row = {}
        for row, (i, nxt) in enumerate(outs):
            ctx.logits[row, nxt] = 1.0
            ctx.out_row[i] = row
        return 0

    def llama_get_logits_ith(self, ctx, i):
        return ctx.logits[ctx.out_row[i]].ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def llama_batch_free(self, b):
        pass

    def llama_free(self, ctx):
        pass

    def llama_model_free(self, model):
        pass


def _toy_greedy(prompt, n, vocab):
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(sum(seq) % vocab)
        seq.append(out[-1])
    return out


def test_peer_runs_the_batch_as_sequences_one_decode_per_step(monkeypatch):
    from pdkv.bench.offline.llamacpp import LlamaCppPeer

    fake = _FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]]
    peer = LlamaCppPeer("m.gguf", "float32", n_threads=2, output_len=4)
    seconds, toks, first = peer.run(prompts, 4)
    assert seconds >= first > 0  # the first tokens come after the prefill decode
    assert toks == [_toy_greedy(p, 4, fake.vocab) for p in prompts]
    ctx = fake.contexts[-1].params
    assert (ctx.n_ctx, ctx.n_seq_max, ctx.n_batch, ctx.n_ubatch) == (3 * (5 + 4), 3, 15, 15)
    assert ctx.n_threads == ctx.n_threads_batch == 2 and ctx.type_k == ctx.type_v == 0  # F32 KV
    # One llama_decode for the whole prefill (logits at each prompt's last token), then one per
    # step.
    assert [n for n, _ in fake.decodes] == [15, 3, 3, 3]
    prefill = fake.decodes[0][1]
    assert [r[3] for r in prefill] == [i % 5 == 4 for i in range(15)]
    assert [r[2] for r in prefill] == [0] * 5 + [1] * 5 + [2] * 5
    assert [r[2] for r in fake.decodes[1][1]] == [0, 1, 2] and [
        r[1] for r in fake.decodes[3][1]
    ] == [7, 7, 7]
    # Same shape again: the context is reused and its cache cleared.
    assert peer.run(prompts, 2)[1] == [t[:2] for t in toks] and len(fake.contexts) == 1
    peer.close()
    with pytest.raises(ValueError):
        peer.run(prompts, 5)  # more than output_len


def test_the_table_header_names_only_the_systems_that_ran():
    # `--no-hf` with llama.cpp skipped: the header must not claim HF or llama.cpp ran.
    result = _result()
    result["workloads"] = workload_rows(result)
    header = format_workload_table(result).splitlines()[0]
    assert header.startswith("pdkv vs HF transformers vs llama.cpp (llama-cpp-python")
    for r in result["workloads"]:
        r["llamacpp"] = None
    header = format_workload_table(result).splitlines()[0]
    assert header.startswith("pdkv vs HF transformers, same token ids") and "llama" not in header
    for r in result["workloads"]:
        r["hf"] = None
    header = format_workload_table(result).splitlines()[0]
    assert header.startswith("pdkv alone (no peer ran)") and " vs " not in header
