"""1P1D as real processes behind `pdkv proxy`, driven by the openai client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from system_packages import in_ci, require

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "router"))

from dashboard_check import live_scope, load, panels, problems  # noqa: E402
from fake_engines import ServerThread  # noqa: E402
from pd_utils import pd_config  # noqa: E402
from prometheus_check import dashboard_expr, prometheus  # noqa: E402
from server_utils import RemoteServer, free_port, metric_value, wait_for_metric  # noqa: E402

from pdkv import SamplingParams  # noqa: E402
from pdkv.router.proxy import build_proxy_app  # noqa: E402

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
    """P and D started side by side (then the proxy, unless `proxy` is False) as processes,
    stopped in reverse order."""

    def __init__(self, transfer: str, policy: str = "fail", proxy: bool = True) -> None:
        self.servers: list[RemoteServer] = []
        try:
            self.p = self._start(
                ["serve", *ENGINE, "--kv-transfer-config", pd_config("kv_producer", transfer)]
            )
            self.d = self._start(["serve", *ENGINE, "--kv-transfer-config",
                                  pd_config("kv_consumer", transfer, policy)])
            for srv in self.servers:
                srv.wait_healthy()
            if proxy:
                self.proxy = self._start(["proxy", "--prefill", self.p.url, "--decode", self.d.url])
                self.proxy.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _start(self, args: list[str]) -> RemoteServer:
        srv = RemoteServer(args, wait=False, avoid=tuple(s.port for s in self.servers))
        self.servers.append(srv)
        return srv

    def stop(self) -> None:
        for srv in reversed(self.servers):
            srv.stop()


@pytest.fixture(scope="module")
def pd_stack():
    stack = _Stack("tcp")
    # One request first: the engines' gauges (free blocks, held blocks) are set from their steps.
    r = httpx.post(stack.proxy.url + "/v1/completions", timeout=120,
                   json={"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert wait_for_metric(stack.p.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    yield stack.p, stack.d, stack.proxy
    stack.stop()


def _mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def parity_refs(parity_reference_24):
    return parity_reference_24


@pytest.mark.parametrize(
    "transfer",
    [
        "tcp",
        "shm",
        pytest.param(
            "mooncake",
            marks=pytest.mark.skipif(
                not _mooncake_available() and not in_ci(),
                reason="mooncake-transfer-engine-non-cuda / libibverbs1 not installed",
            ),
        ),
    ],
)
def test_parity_prompts_through_proxy_match_colocated(
    transfer, parity_prompts, parity_refs, request
):
    """The ten block-boundary chat prompts (63..129 tokens) through a 1P1D proxy, five at a time
    (the engines batch them). tcp uses the module's stack and all ten; shm and mooncake (the
    same connector over another transfer engine) every other one, to keep the suite's time."""
    own = None if transfer == "tcp" else _Stack(transfer)
    if own is not None:
        parity_prompts, parity_refs = parity_prompts[::2], parity_refs[::2]
    p, d, proxy = request.getfixturevalue("pd_stack") if own is None else (own.p, own.d, own.proxy)
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)

        def one(ids: list[int]) -> Any:
            return client.completions.create(
                model="smollm2", prompt=ids, max_tokens=24, temperature=0
            )

        with ThreadPoolExecutor(5) as pool:
            outs = list(pool.map(one, parity_prompts))
        for ids, ref, out in zip(parity_prompts, parity_refs, outs):
            assert out.choices[0].text == ref.outputs[0].text, (
                f"{len(ids)}-token prompt via {transfer}"
            )
            assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
            assert out.usage.prompt_tokens == len(ids)
        received = metric_value(
            httpx.get(d.url + "/metrics").text, "pdkv:kv_transfer_bytes_received_total"
        )
        assert received > 0
        assert wait_for_metric(p.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
        assert wait_for_metric(d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    finally:
        if own is not None:
            own.stop()


def test_prefill_process_killed_after_params_recompute(reference):
    """P is SIGKILLed after answering the prefill leg; D (recompute policy) still answers right.
    The test drives both legs itself, so its stack has no proxy."""
    stack = _Stack("tcp", policy="recompute", proxy=False)
    try:
        body = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0}
        leg = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        params = httpx.post(stack.p.url + "/v1/completions", json=leg, timeout=60).json()[
            "kv_transfer_params"
        ]
        os.killpg(stack.p.proc.pid, signal.SIGKILL)
        stack.p.proc.wait(10)
        t0 = time.monotonic()
        r = httpx.post(
            stack.d.url + "/v1/completions",
            json={**body, "kv_transfer_params": params},
            timeout=120,
        )
        assert time.monotonic() - t0 < 60
        assert r.status_code == 200
        ref = reference.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))[0]
        assert r.json()["choices"][0]["text"] == ref.outputs[0].text
        text = httpx.get(stack.d.url + "/metrics").text
        assert metric_value(text, "pdkv:kv_load_failures_total", policy="recompute") == 1
        assert wait_for_metric(stack.d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def reference(smollm2_reference):
    """The session's colocated SmolLM2 engine (tests/conftest.py)."""
    return smollm2_reference


def _free(url: str) -> float:
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, "pdkv:num_free_blocks")


def test_proxy_outputs_match_colocated(pd_stack, reference):
    p, d, proxy = pd_stack
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    refs = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    for prompt, ref in zip(PROMPTS, refs):
        out = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=20, temperature=0
        )
        assert out.choices[0].text == ref.outputs[0].text
        assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert out.usage.prompt_tokens_details.cached_tokens == len(ref.prompt_token_ids) - 1
        chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=20,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ref = reference.chat([msgs], SamplingParams(temperature=0, max_tokens=16))[0]
    out = client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=16, temperature=0
    )
    assert out.choices[0].message.content == ref.outputs[0].text
    received = metric_value(
        httpx.get(d.url + "/metrics").text, "pdkv:kv_transfer_bytes_received_total"
    )
    assert received > 0
    assert wait_for_metric(p.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    assert wait_for_metric(d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS


def _sources(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {s: metric_value(text, "pdkv:prompt_tokens_by_source_total", source=s)
           for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    return {**out, "queries": metric_value(text, "pdkv:prefix_cache_queries_total")}


def test_pd_prompt_token_counts_sum_and_grafana_pd_panels_are_live(pd_stack):
    """One new prompt through 1P1D: D counts it in its prefix-cache queries and its pulled
    tokens as external, not computed (it computes only the last one), so local_compute summed
    over P and D is the prompt plus one. Then the dashboard check (tests/serve/dashboard_check)
    over both engines' /metrics, with the "Always live (P/D)" panels too."""
    p, d, proxy = pd_stack
    assert wait_for_metric(d.url, "pdkv:num_requests_running", 0) == 0
    p0, d0 = _sources(p.url), _sources(d.url)
    body = {
        "model": "smollm2",
        "prompt": "A field guide to the mosses of the northern forest, part two:",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 30
    while True:
        p1, d1 = _sources(p.url), _sources(d.url)
        dp = {k: p1[k] - p0[k] for k in p1}
        dd = {k: d1[k] - d0[k] for k in d1}
        text = [httpx.get(u + "/metrics", timeout=10).text for u in (p.url, d.url)]
        found = problems(load(), text, {"any deployment", "P/D"})
        if (dd["queries"] and not found) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert found == []
    assert dp["local_compute"] + dp["local_cache_hit"] == n and dp["external_kv_transfer"] == 0
    assert dd["queries"] == n  # the P/D request was looked up in D's prefix cache
    assert dd["local_compute"] == 1  # the last prompt token, for its logits
    assert dd["external_kv_transfer"] + dd["local_cache_hit"] == n - 1
    assert dd["external_kv_transfer"] > 0


def test_every_dashboard_panel_queried_through_a_real_prometheus(pd_stack, tmp_path, capsys):
    """docs/grafana.json against Prometheus itself (not a regex): it scrapes P, D and the proxy
    during a short `pdkv bench serve` through the proxy; every target's PromQL, with the
    dashboard's variables substituted, is valid, each "Always live" panel returns series, and a
    panel that returns none says in its description why it is empty in this deployment."""
    require("prometheus")
    p, d, proxy = pd_stack
    from pdkv.cli import main as pdkv_main

    hostports = [u.removeprefix("http://") for u in (p.url, d.url, proxy.url)]
    with prometheus(hostports, tmp_path) as prom:
        deadline = time.monotonic() + 60
        while set(prom.targets_up().values()) != {"up"} or len(prom.targets_up()) != 3:
            assert time.monotonic() < deadline, prom.targets_up()
            time.sleep(0.5)
        rc = pdkv_main(
            [
                "bench",
                "serve",
                "--base-url",
                proxy.url,
                "--backend",
                "openai",
                "--dataset-name",
                "random",
                "--random-input-len",
                "32",
                "--random-output-len",
                "4",
                "--num-prompts",
                "4",
                "--disable-tqdm",
            ]
        )
        assert rc == 0, capsys.readouterr().out
        # Two scrapes after the run, so every rate() window holds the run's increments.
        settle = time.monotonic() + 60
        while not prom.query("sum(increase(pdkv:request_success_total[30s])) > 0"):
            assert time.monotonic() < settle, "the run never showed up in Prometheus"
            time.sleep(0.5)
        time.sleep(2.5)
        empty, live_empty = [], []
        for panel in panels(load()):
            series = [s for t in panel["targets"] for s in prom.query(dashboard_expr(t["expr"]))]
            if series:
                continue
            if live_scope(panel) in ("any deployment", "P/D"):
                live_empty.append(panel["title"])
            elif "Empty " not in panel["description"]:
                empty.append(panel["title"])
        assert live_empty == [], f"always-live panels without data: {live_empty}"
        assert empty == [], f"panels without data whose description does not say why: {empty}"
        assert any(
            s["metric"].get("job") == "pdkv" for s in prom.query("pdkv:proxy_requests_total")
        )


def test_sampling_options_carried_to_decode_match_colocated(pd_stack, reference):
    """The decode leg carries every sampling option: P/D text equals the colocated engine's;
    n > 1 and prompt_logprobs get a 400 naming them."""
    _, _, proxy = pd_stack
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    prompt = PROMPTS[0]
    options = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3,
               "min_p": 0.2, "seed": 4, "temperature": 0.8, "logit_bias": {13: -100}}
    ref = reference.generate(prompt, SamplingParams(max_tokens=8, **options))[0].outputs[0]
    plain = reference.generate(prompt, SamplingParams(max_tokens=8, seed=4, temperature=0.8))[0]
    assert ref.text != plain.outputs[0].text
    extra = {k: options[k] for k in ("repetition_penalty", "min_p")}
    std = {k: v for k, v in options.items() if k not in extra}
    std["logit_bias"] = {"13": -100}
    out = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, extra_body=extra, **std
    )
    assert out.choices[0].text == ref.text
    for field, kw in (("n", {"n": 2}), ("prompt_logprobs", {"extra_body": {"prompt_logprobs": 1}})):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, **kw)


def test_over_length_prompt_is_400_without_transfer(pd_stack):
    p, d, proxy = pd_stack
    before = metric_value(
        httpx.get(d.url + "/metrics").text, "pdkv:kv_transfer_bytes_received_total"
    )
    r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                   json={"model": "smollm2", "prompt": [1] * (MAX_LEN + 10), "max_tokens": 4})
    assert r.status_code == 400
    assert "maximum context length" in r.json()["error"]["message"]
    after = metric_value(
        httpx.get(d.url + "/metrics").text, "pdkv:kv_transfer_bytes_received_total"
    )
    assert after == before
    assert _free(p.url) == BLOCKS and _free(d.url) == BLOCKS
    assert metric_value(httpx.get(p.url + "/metrics").text, "pdkv:num_blocks_held_for_remote") == 0


def _counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return metric_value(text, "pdkv:prompt_tokens_total"), metric_value(
        text, "pdkv:request_success_total"
    )


@pytest.mark.parametrize("body", [
    {"prompt": PROMPTS[1], "max_tokens": 0},
    {"prompt": PROMPTS[1], "max_tokens": 2, "min_tokens": 3},
    {"prompt": [7] * (MAX_LEN - 20), "max_tokens": 40},
    {"prompt": "word " * (MAX_LEN - 40), "max_tokens": 60},
    {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": float("nan")},
], ids=["max_tokens_0", "min_over_max", "ids_over_length", "text_over_length", "nan"])
def test_what_decode_would_reject_is_400_before_any_prefill(pd_stack, body):
    """The proxy answers 400 without a prefill leg: P's prompt-token and request counters stay."""
    p, d, proxy = pd_stack
    before = _counters(p.url)
    content = json.dumps(body, allow_nan=True).encode()
    r = httpx.post(proxy.url + "/v1/completions", content=content, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError"
    assert _counters(p.url) == before
    assert metric_value(httpx.get(p.url + "/metrics").text, "pdkv:num_blocks_held_for_remote") == 0


def _send_raw(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def test_client_gone_after_prefill_releases_p_blocks_before_the_lease(pd_stack):
    """Forced order: the proxy (in-process, with its test hook) holds between the legs until the
    client has disconnected; P's held blocks come back far sooner than the 30 s lease."""
    p, d, proxy = pd_stack
    reached = threading.Event()

    async def hold(params):
        reached.set()
        await asyncio.sleep(60)  # cancelled by the disconnect

    expirations = metric_value(
        httpx.get(p.url + "/metrics").text, "pdkv:kv_lease_expirations_total"
    )
    server = ServerThread(build_proxy_app([p.url], [d.url], before_decode=hold))
    try:
        body = json.dumps({"model": "smollm2", "prompt": PROMPTS[2], "max_tokens": 8}).encode()
        with _send_raw(server.port, body):
            assert reached.wait(60)
        t0 = time.monotonic()
        assert wait_for_metric(p.url, "pdkv:num_blocks_held_for_remote", 0, timeout=10) == 0
        assert wait_for_metric(p.url, "pdkv:num_free_blocks", BLOCKS, timeout=10) == BLOCKS
        assert time.monotonic() - t0 < 15  # the lease is 30 s
        text = httpx.get(p.url + "/metrics").text
        assert metric_value(text, "pdkv:kv_lease_expirations_total") == expirations
        assert (
            metric_value(
                httpx.get(d.url + "/metrics").text, "pdkv:num_requests_waiting_for_remote_kv"
            )
            == 0
        )
    finally:
        server.stop()


def _reasons(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        r: metric_value(text, "pdkv:request_success_total", finished_reason=r)
        for r in ("abort", "length")
    }


def test_client_disconnect_mid_stream_aborts_decode_and_frees_both_sides(pd_stack):
    """A ~490-token generation cannot finish before the client leaves after 3 chunks: D counts
    an abort (not a length finish) and both engines get all their blocks back."""
    p, d, proxy = pd_stack
    before = _reasons(d.url)
    body = {"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": MAX_LEN - 20,
            "ignore_eos": True, "stream": True, "temperature": 0}
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", proxy.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 3:
                break
    assert wait_for_metric(d.url, "pdkv:num_requests_running", 0) == 0
    after = _reasons(d.url)
    assert after["abort"] == before["abort"] + 1 and after["length"] == before["length"]
    assert wait_for_metric(d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    assert wait_for_metric(p.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    assert metric_value(httpx.get(p.url + "/metrics").text, "pdkv:num_blocks_held_for_remote") == 0


def test_client_disconnect_during_non_streamed_decode_aborts_it(pd_stack):
    """The client leaves once D is running its request (seen on D's metrics, not timed)."""
    p, d, proxy = pd_stack
    before = _reasons(d.url)
    body = json.dumps(
        {
            "model": "smollm2",
            "prompt": "Tell me a long story.",
            "max_tokens": MAX_LEN - 20,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
    with _send_raw(int(proxy.url.rsplit(":", 1)[1]), body):
        assert wait_for_metric(d.url, "pdkv:num_requests_running", 1, timeout=60) == 1
    assert wait_for_metric(d.url, "pdkv:num_requests_running", 0) == 0
    after = _reasons(d.url)
    assert after["abort"] == before["abort"] + 1 and after["length"] == before["length"]
    assert wait_for_metric(d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    assert wait_for_metric(p.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS


def test_layout_mismatch_is_503_on_health_and_requests(pd_stack):
    """A D with another dtype (an identity field; a block size differing is converted) behind
    the proxy: /health is 503 naming both values, and a request is a 503 (the deployment's fault,
    not the client's) that never reaches P."""
    p, _, _ = pd_stack
    with RemoteServer(["serve", *ENGINE, "--dtype", "bfloat16", "--kv-transfer-config",
                       pd_config("kv_consumer", "tcp")], wait=False) as dbf16, \
            RemoteServer(["proxy", "--prefill", p.url, "--decode", dbf16.url], health_path="/ping",
                         avoid=(dbf16.port,)) as proxy:
        dbf16.wait_healthy()
        h = httpx.get(proxy.url + "/health", timeout=30)
        assert h.status_code == 503
        assert "dtype: producer='float32' consumer='bfloat16'" in h.json()["error"]["message"]
        before = _counters(p.url)
        r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                       json={"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 4})
        assert r.status_code == 503
        assert "dtype: producer='float32' consumer='bfloat16'" in r.json()["error"]["message"]
        assert _counters(p.url) == before
        layout = httpx.get(dbf16.url + "/kv_layout", timeout=10).json()
        assert layout["kv_role"] == "kv_consumer" and layout["layout"]["dtype"] == "bfloat16"


def test_an_unreachable_decode_is_a_503_that_never_reaches_p(pd_stack):
    """The only decode engine is not there: the proxy's /health says so and a request is a 503
    before the prefill leg (P computes nothing)."""
    p, _, _ = pd_stack
    dead = f"http://127.0.0.1:{free_port()}"
    with RemoteServer(
        ["proxy", "--prefill", p.url, "--decode", dead], health_path="/ping"
    ) as proxy:
        h = httpx.get(proxy.url + "/health", timeout=30)
        assert h.status_code == 503
        assert [b["healthy"] for b in h.json()["backends"]] == [True, False]
        before = _counters(p.url)
        r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                       json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 503
        assert "no healthy decode backend" in r.json()["error"]["message"]
        assert _counters(p.url) == before


def _read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> list[str]:
    """Lines of `proc`'s stdout up to the one starting with `marker` (raises on exit or timeout)."""
    import queue

    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, "pdkv up exited:\n" + "".join(seen)
        seen.append(line)
        if line.startswith(marker):
            return seen


def test_pdkv_up_pd_demo_bench_serve_and_request_logs(tmp_path, capsys):
    """README's main job, in one 1P1D `pdkv up --mode pd`: it lists each process (role, URL,
    threads, log file); the demo answers real chat prompts through the proxy; `pdkv bench serve`
    with vLLM's flag names runs through the proxy and counts input tokens with the model's
    tokenizer (the proxy forwards /v1/models, /tokenize and /detokenize to D); each engine logs
    one line per finished request (D's name the pulled tokens and bytes) and stats lines."""
    from pdkv.launch.demo import run_demo

    logs = tmp_path / "logs"
    up = subprocess.Popen(
        [sys.executable, "-m", "pdkv.cli", "up", "--mode", "pd", "--log-dir", str(logs), "--",
         "--num-kv-blocks", "256", "--max-model-len", "1024", "--log-stats-interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        listing = "".join(_read_until(up, "ready: ", timeout=400))
        endpoint = listing.split("ready: ")[1].split()[0]
        for name, role in (
            ("prefill0", "prefill (kv_producer)"),
            ("decode0", "decode (kv_consumer)"),
        ):
            assert f"  {name}: {role}, http://127.0.0.1:" in listing
            assert re.search(rf" \d+ threads?, log {re.escape(str(logs / name))}\.log", listing), (
                listing
            )
        assert "  proxy: proxy (P/D, round_robin), " + endpoint in listing
        d_url = listing.split("  decode0: decode (kv_consumer), ")[1].split(",")[0]

        run_demo(endpoint, [d_url], "smollm2")
        demo = capsys.readouterr().out
        assert "Paris" in demo
        assert demo.count("KV moved P->D") == 4

        from pdkv.cli import main as pdkv_main

        t0 = time.monotonic()
        rc = pdkv_main(
            [
                "bench",
                "serve",
                "--base-url",
                endpoint,
                "--backend",
                "openai",
                "--dataset-name",
                "random",
                "--random-input-len",
                "32",
                "--random-output-len",
                "4",
                "--num-prompts",
                "2",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "bench.json",
                "--disable-tqdm",
            ]
        )
        print(f"bench serve took {time.monotonic() - t0:.1f} s")
        assert rc == 0, capsys.readouterr().out
        result = json.loads((tmp_path / "bench.json").read_text())
        assert result["completed"] == 2 and result["config"]["endpoint"] == "completions"
        assert result["config"]["tokenizer"] == "server"  # the model's tokenizer, through the proxy
        assert result["input_lens"] == [32, 32]
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
    d_log = (logs / "decode0.log").read_text()
    p_log = (logs / "prefill0.log").read_text()
    finished = [line for line in d_log.splitlines() if "finished request " in line]
    assert len(finished) == 6  # 4 demo prompts + 2 bench requests
    assert all("kv_bytes=0 " not in line and "pulled_tokens=0 " not in line and "(p2p=" in line
               for line in finished)
    assert p_log.count("finished request ") == 6
    assert "Avg prompt throughput: " in p_log and "Avg generation throughput: " in d_log
