"""`pdkv plan --pcp N`: PCP's compute and all-gather terms against a hand computation, the
crossover prompt length, and the refusals (issue 32). Torch-free."""

from __future__ import annotations

import json

import pytest

from pdkv.cli import main
from pdkv.plan.pcp import (
    PcpModel,
    PcpShape,
    allgather_bytes,
    calibrate_flops,
    fit_single_rank,
    rank_work,
)

# tiny-llama-kv2's dimensions (its config.json as pdkv builds it)
TINY = PcpShape(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                intermediate_size=256, vocab_size=49152)


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path / "cache"))


def test_terms_of_a_130_token_prefill_on_2_ranks_by_hand():
    # 4 chunks of ceil(130/4) = 33: [0,33) [33,66) [66,99) [99,130); rank 0 has chunks 0 and 3,
    # rank 1 chunks 1 and 2.
    # weights per layer: q 128·128 + k,v 2·128·64 + o 128·128 + gate,up,down 3·128·256 = 147,456
    assert TINY.layer_weights == 147_456
    r0, r1 = rank_work(TINY, 130, 2)
    assert (r0.rows, r1.rows) == (64, 66)
    # causal pairs: Σ(p+1) over the rank's positions
    assert r0.key_pairs == 33 * 34 // 2 + (130 * 131 - 99 * 100) // 2 == 4126
    assert r1.key_pairs == (99 * 100 - 33 * 34) // 2 == 4389
    lm_head = 2 * 128 * 49152
    assert r1.flops == 4 * 66 * 2 * 147_456 + 4 * 4389 * 4 * 4 * 32 + lm_head
    one = rank_work(TINY, 130, 1)[0]
    assert one.rows == 130 and one.key_pairs == 130 * 131 // 2
    assert r0.key_pairs + r1.key_pairs == one.key_pairs  # the split covers every pair once
    # all-gather per rank: 4 layers × 66 rows (padded to the fullest) × 2 × 2 heads × 32 × 4 B,
    # plus the sampled row 128 × 4 B, each × (N−1) = 1
    assert allgather_bytes(TINY, 130, 2, 4, 4) == 4 * 66 * 2 * 2 * 32 * 4 + 128 * 4 == 135_680
    m = PcpModel(TINY, 2, flops_per_s=1e9, bandwidth=1e8, latency=1e-4, kv_bytes=4, act_bytes=4)
    c = m.cost(130)
    assert c.single_s == pytest.approx(one.flops / 1e9)
    assert c.compute_s == pytest.approx(r1.flops / 1e9)  # the busier rank sets the time
    assert c.comm_s == pytest.approx(5 * 1 * 1e-4 + 135_680 / 1e8)  # 4 + 1 all-gathers
    # shorter than 2N × 16 = 64 tokens: not split, every rank runs it whole, no all-gather
    short = m.cost(63)
    assert short.comm_bytes == 0 and short.compute_s == short.single_s


def test_crossover_is_the_first_gaining_length_and_grows_as_bandwidth_falls():
    f = calibrate_flops(TINY, 1024, 0.05)
    crossings = []
    for bw in (1e11, 1e10, 1e9, 1e8, 1e7):
        m = PcpModel(TINY, 2, f, bw, 5e-5, 4, 4)
        n = m.crossover()
        assert n is not None
        c, before = m.cost(n), m.cost(n - 1)
        assert c.pcp_s < c.single_s
        assert n == 64 or before.pcp_s >= before.single_s
        crossings.append(n)
    assert crossings == sorted(crossings) and crossings[-1] > crossings[0]
    # 2 ranks sharing the cores one rank had, linear in cores: the split buys no compute
    assert PcpModel(TINY, 2, f, 1e11, 0.0, 4, 4, shared_speedup=2).crossover() is None


def test_fit_recovers_overhead_and_flops_and_overhead_is_not_split():
    t0, f = 0.02, 3e9
    samples = [(n, t0 + rank_work(TINY, n, 1)[0].flops / f) for n in (128, 512, 2048)]
    got_t0, got_f = fit_single_rank(TINY, samples)
    assert got_t0 == pytest.approx(t0) and got_f == pytest.approx(f)
    one_t0, one_f = fit_single_rank(TINY, samples[:1])  # one sample: all of it is compute
    assert one_t0 == 0 and one_f == pytest.approx(calibrate_flops(TINY, 128, samples[0][1]))
    c = PcpModel(TINY, 2, f, 1e9, 0.0, 4, 4, overhead_s=t0).cost(512)
    assert c.single_s == pytest.approx(samples[1][1])
    assert c.pcp_s == pytest.approx(t0 + c.compute_s + c.comm_s)
    assert calibrate_flops(TINY, 512, samples[1][1], t0) == pytest.approx(f)


def run_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["figures"]


def test_cli_smollm2_pcp2(capsys):
    f = run_json(capsys, "--model", "smollm2", "--prompt-len", "2048", "--pcp", "2",
                 "--prefill-tps", "1000", "--pcp-bandwidth", "1e9", "--pcp-latency", "0")
    # 30 layers × 1024 rows × 2 × 3 kv heads × 64 × 4 B (fp32) + 576 × 4 B
    assert f["pcp_comm_bytes"]["value"] == 30 * 1024 * 2 * 3 * 64 * 4 + 576 * 4
    assert f["pcp_comm_s"]["value"] == pytest.approx(f["pcp_comm_bytes"]["value"] / 1e9)
    assert f["pcp_single_s"]["value"] == pytest.approx(2.048)
    assert f["pcp_prefill_s"]["value"] == pytest.approx(
        f["pcp_compute_s"]["value"] + f["pcp_comm_s"]["value"])
    assert f["pcp_crossover_tokens"]["unit"] == "tokens"
    over = run_json(capsys, "--model", "smollm2", "--prompt-len", "2048", "--pcp", "2",
                    "--prefill-tps", "1000", "--pcp-overhead", "0.5")
    assert over["pcp_flops_per_s"]["value"] == pytest.approx(
        f["pcp_single_flops"]["value"] / (2.048 - 0.5))
    assert over["pcp_prefill_s"]["value"] == pytest.approx(
        0.5 + over["pcp_compute_s"]["value"] + over["pcp_comm_s"]["value"])
    shared = run_json(capsys, "--model", "smollm2", "--prompt-len", "2048", "--pcp", "2",
                      "--prefill-tps", "1000", "--pcp-shared-speedup", "2")
    assert shared["pcp_crossover_tokens"]["value"] is None
    assert shared["pcp_speedup"]["value"] < 1


@pytest.mark.parametrize("args, says", [
    (("--model", "smollm2", "--prompt-len", "512", "--pcp", "0"), "pcp must be >= 1"),
    (("--model", "llama-3.1-70b", "--prompt-len", "512", "--pcp", "2", "--tp", "2"),
     "not built"),
    (("--kv-bytes", "1e6", "--prompt-len", "512", "--pcp", "2"), "need --model"),
    (("--model", "gemma-3-27b", "--prompt-len", "512", "--pcp", "2"), "sliding_window"),
    (("--model", "smollm2", "--pcp", "2"), "--prompt-len"),
    (("--model", "smollm2", "--prompt-len", "512", "--pcp", "2", "--pcp-shared-speedup", "0"),
     "must be > 0"),
])
def test_refusals(capsys, args, says):
    assert main(["plan", *args]) == 2
    assert says in capsys.readouterr().err
