"""Acceptance: `pdkv bench serve` through a real 1P1D proxy (in-process P and D servers over
SmolLM2, tcp transfer) reports the TTFT phases, and for prompts of >= 512 tokens their sum (with
the residuals) is within 15 % of the client's TTFT; the KV bytes come from the engines' /metrics
found through the proxy."""

from __future__ import annotations

import pytest

from pdkv.bench.serve import BenchConfig, run_serve_bench
from pdkv.bench.serve.report import format_result_table
from pdkv.engine.arg_utils import EngineArgs
from pdkv.engine.async_llm import AsyncLLM
from pdkv.engine.llm_engine import LLMEngine
from pdkv.router.proxy import build_proxy_app
from pdkv.router.timings import PD_PHASES
from pdkv.serve.api_server import ServeConfig, build_app
from pdkv.serve.metrics import ServerMetrics
from tests.kv_transfer.pd_utils import pd_config
from tests.router.fake_engines import ServerThread

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 520


def _engine(role: str) -> ServerThread:
    args = EngineArgs(model="smollm2", num_kv_blocks=128, max_model_len=1024,
                      kv_transfer_config=pd_config(role, "tcp"))
    metrics = ServerMetrics("smollm2")
    llm = AsyncLLM(LLMEngine.from_engine_args(args), metrics.observe_step)
    return ServerThread(build_app(llm, ServeConfig(), metrics))


def test_bench_serve_through_1p1d_reports_phases_that_add_up_to_client_ttft():
    servers: list[ServerThread] = []
    try:
        p = _engine("kv_producer")
        servers.append(p)
        d = _engine("kv_consumer")
        servers.append(d)
        proxy = ServerThread(build_proxy_app([p.url], [d.url]))
        servers.append(proxy)
        cfg = BenchConfig(base_url=proxy.url, num_prompts=1, input_len=PROMPT_TOKENS, output_len=2,
                          max_concurrency=1, disable_tqdm=True, seed=3)
        result = run_serve_bench(cfg, log=lambda s: None)
    finally:
        for srv in reversed(servers):
            srv.stop()
    print(format_result_table(result))
    assert result["completed"] == 1, result["errors"]
    assert all(n >= 512 for n in result["input_lens"])
    phases = result["ttft_phases"]
    assert phases["modes"] == ["pd"] and list(phases["phases"]) == [*PD_PHASES, "client_residual"]
    for ttft, t in zip(result["ttfts"], result["pdkv_timings"]):
        ph = t["phases"]
        assert sum(ph.values()) == pytest.approx(t["total"], abs=1e-4)
        assert 0.85 <= t["total"] / ttft <= 1.15, (t, ttft)
        assert ph["p_prefill"] > 0 and ph["transfer"] > 0 and ph["d_first_step"] > 0
    ratio = phases["sum_over_ttft"]
    assert ratio["min"] >= 0.85 and ratio["max"] <= 1.15
    server = result["server_metrics"]
    assert server["kv_p2p_bytes_received"] > 0 and server["proxy_prefill_legs"] == 1
    assert len(server["sources"]) == 3  # the proxy, P and D
