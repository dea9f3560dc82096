"""1P1D as real processes behind `pdkv proxy`, driven by the openai client."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import pd_config  # noqa: E402
from server_utils import RemoteServer, free_port, metric_value, wait_for_metric  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

BLOCKS = 256
MAX_LEN = 512
ENGINE = ["--model", "smollm2", "--num-kv-blocks", str(BLOCKS), "--max-model-len", str(MAX_LEN)]
PROMPTS = [
    "The three most important inventions of the twentieth century are",
    "Here is a recipe for a simple tomato soup:",
    "In a distant galaxy, a small robot",
]


class _Stack:
    """P, D and a proxy as processes, stopped in reverse order."""

    def __init__(self, transfer: str, policy: str = "fail") -> None:
        self.servers: list[RemoteServer] = []
        try:
            self.p = self._start(["serve", *ENGINE, "--kv-transfer-config", pd_config("kv_producer", transfer)])
            self.d = self._start(["serve", *ENGINE, "--kv-transfer-config",
                                  pd_config("kv_consumer", transfer, policy)])
            self.proxy = self._start(["proxy", "--prefill", self.p.url, "--decode", self.d.url])
        except BaseException:
            self.stop()
            raise

    def _start(self, args: list[str]) -> RemoteServer:
        srv = RemoteServer(args)
        self.servers.append(srv)
        return srv

    def stop(self) -> None:
        for srv in reversed(self.servers):
            srv.stop()


@pytest.fixture(scope="module")
def pd_stack():
    stack = _Stack("tcp")
    yield stack.p, stack.d, stack.proxy
    stack.stop()


def _mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("transfer", ["tcp", "shm", pytest.param("mooncake", marks=pytest.mark.skipif(
    not _mooncake_available(), reason="mooncake-transfer-engine-non-cuda / libibverbs1 not installed"))])
def test_parity_prompts_through_proxy_match_colocated(transfer, parity_prompts, reference):
    """The ten block-boundary chat prompts (63..129 tokens) through a 1P1D proxy, per engine."""
    refs = reference.generate([{"prompt_token_ids": ids} for ids in parity_prompts],
                              SamplingParams(temperature=0, max_tokens=24))
    stack = _Stack(transfer)
    try:
        client = openai.OpenAI(base_url=stack.proxy.url + "/v1", api_key="x", max_retries=0)
        for ids, ref in zip(parity_prompts, refs):
            out = client.completions.create(model="smollm2", prompt=ids, max_tokens=24, temperature=0)
            assert out.choices[0].text == ref.outputs[0].text, f"{len(ids)}-token prompt via {transfer}"
            assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
            assert out.usage.prompt_tokens == len(ids)
        received = metric_value(httpx.get(stack.d.url + "/metrics").text, "pdkv:kv_transfer_bytes_received_total")
        assert received > 0
        assert wait_for_metric(stack.p.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
        assert wait_for_metric(stack.d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    finally:
        stack.stop()


def test_prefill_process_killed_after_params_recompute():
    """P is SIGKILLed after answering the prefill leg; D (recompute policy) still answers right."""
    import signal

    stack = _Stack("tcp", policy="recompute")
    try:
        body = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0}
        leg = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        params = httpx.post(stack.p.url + "/v1/completions", json=leg, timeout=60).json()["kv_transfer_params"]
        os.killpg(stack.p.proc.pid, signal.SIGKILL)
        stack.p.proc.wait(10)
        t0 = time.monotonic()
        r = httpx.post(stack.d.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=120)
        assert time.monotonic() - t0 < 60
        assert r.status_code == 200
        ref = LLM("smollm2", num_kv_blocks=64, max_model_len=MAX_LEN).generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))[0]
        assert r.json()["choices"][0]["text"] == ref.outputs[0].text
        text = httpx.get(stack.d.url + "/metrics").text
        assert metric_value(text, "pdkv:kv_load_failures_total", policy="recompute") == 1
        assert wait_for_metric(stack.d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def reference():
    llm = LLM("smollm2", num_kv_blocks=BLOCKS, max_model_len=MAX_LEN)
    yield llm
    llm.llm_engine.shutdown()


def _free(url: str) -> float:
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, "pdkv:num_free_blocks")


def test_proxy_outputs_match_colocated(pd_stack, reference):
    p, d, proxy = pd_stack
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    refs = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    for prompt, ref in zip(PROMPTS, refs):
        out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0)
        assert out.choices[0].text == ref.outputs[0].text
        assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert out.usage.prompt_tokens_details.cached_tokens == len(ref.prompt_token_ids) - 1
        chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=20,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ref = reference.chat([msgs], SamplingParams(temperature=0, max_tokens=16))[0]
    out = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == ref.outputs[0].text
    received = metric_value(httpx.get(d.url + "/metrics").text, "pdkv:kv_transfer_bytes_received_total")
    assert received > 0
    assert wait_for_metric(p.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    assert wait_for_metric(d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS


def test_over_length_prompt_is_400_without_transfer(pd_stack):
    p, d, proxy = pd_stack
    before = metric_value(httpx.get(d.url + "/metrics").text, "pdkv:kv_transfer_bytes_received_total")
    r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                   json={"model": "smollm2", "prompt": [1] * (MAX_LEN + 10), "max_tokens": 4})
    assert r.status_code == 400
    assert "maximum context length" in r.json()["error"]["message"]
    after = metric_value(httpx.get(d.url + "/metrics").text, "pdkv:kv_transfer_bytes_received_total")
    assert after == before
    assert _free(p.url) == BLOCKS and _free(d.url) == BLOCKS
    assert metric_value(httpx.get(p.url + "/metrics").text, "pdkv:num_blocks_held_for_remote") == 0


def test_decode_rejection_releases_prefill_blocks_at_once(pd_stack):
    """max_tokens=0 passes the prefill leg (forced to 1) but D rejects it: the proxy passes the
    400 through and tells P to release, so nothing stays held until the lease expires."""
    p, d, proxy = pd_stack
    r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                   json={"model": "smollm2", "prompt": PROMPTS[1], "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    t0 = time.monotonic()
    assert wait_for_metric(p.url, "pdkv:num_blocks_held_for_remote", 0, timeout=10) == 0
    assert wait_for_metric(p.url, "pdkv:num_free_blocks", BLOCKS, timeout=10) == BLOCKS
    assert time.monotonic() - t0 < 10  # far below the 30 s lease
    assert metric_value(httpx.get(p.url + "/metrics").text, "pdkv:kv_lease_expirations_total") == 0


def test_client_disconnect_mid_stream_frees_both_sides(pd_stack):
    p, d, proxy = pd_stack
    body = {"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 300,
            "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as c, c.stream("POST", proxy.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 3:
                break
    assert wait_for_metric(d.url, "pdkv:num_requests_running", 0) == 0
    assert wait_for_metric(d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    assert wait_for_metric(p.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS


def test_unreachable_decode_is_502(pd_stack):
    p, _, _ = pd_stack
    dead = f"http://127.0.0.1:{free_port()}"
    with RemoteServer(["proxy", "--prefill", p.url, "--decode", dead], health_path="/ping") as proxy:
        assert httpx.get(proxy.url + "/health", timeout=30).status_code == 503
        r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                       json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 502
        assert "unreachable" in r.json()["error"]["message"]


def test_pdkv_up_demo_runs_real_prompts(tmp_path):
    """README's main job: `pdkv up --mode pd --demo` answers real chat prompts through the proxy."""
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "up", "--mode", "pd", "--demo", "--log-dir",
         str(tmp_path / "logs"), "--", "--num-kv-blocks", "256", "--max-model-len", "1024"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Paris" in out.stdout
    assert out.stdout.count("KV moved P->D") == 4
    assert time.monotonic() - t0 < 600
