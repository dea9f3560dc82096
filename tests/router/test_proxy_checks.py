"""What the proxy answers before the prefill leg (strict JSON, fields D would reject, prompt
length, KV layout mismatch, no healthy engine), the release it sends P when a client leaves
during or between the legs, per-engine health, and its 502s (logged; the keep-alive race retried).
Fake engines, no model."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest
from fake_engines import (
    LAYOUT,
    FakeControl,
    FakeEngine,
    KeepAliveRaceEngine,
    ServerThread,
    SilentEngine,
    metric,
)

from pdkv.ports import free_port
from pdkv.router.backend_health import HealthCheckConfig
from pdkv.router.proxy import build_proxy_app
from pdkv.router.validate import BadRequest, check_body, parse_body


@pytest.mark.parametrize("raw", [
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "temperature": -Infinity}',
    b'{"prompt": "x", "temperature": 1e400}',
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "x", "stop": ["\\udfff"]}',
    b'{"\\ud800": 1}',
    b'{"prompt": "\xff"}',
    b'[1, 2]',
    b'{"prompt": ',
])
def test_parse_body_rejects_what_is_not_strict_json(raw):
    with pytest.raises(BadRequest):
        parse_body(raw)


def test_parse_body_keeps_valid_unicode_and_numbers():
    body = parse_body('{"prompt": "café \\ud83d\\ude00", "temperature": 0.5, "n": 1}'.encode())
    assert body == {"prompt": "café \U0001F600", "temperature": 0.5, "n": 1}


@pytest.mark.parametrize(
    "body, chat, match",
    [
        ({"prompt": "x", "max_tokens": 0}, False, "max_tokens must be at least 1, got 0"),
        ({"prompt": "x", "max_tokens": -3}, False, "at least 1"),
        ({"prompt": "x", "max_tokens": "many"}, False, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.5}, False, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, False, "must be an integer"),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, False, "min_tokens"),
        ({"prompt": "x", "min_tokens": -1}, False, "min_tokens"),
        ({"prompt": "x", "stream_options": "yes"}, False, "stream_options"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            True,
            "max_completion_tokens must be at least 1",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            True,
            "max_tokens must be at least 1",
        ),
    ],
)
def test_check_body_rejects_what_the_prefill_leg_would_hide(body, chat, match):
    with pytest.raises(BadRequest, match=match):
        check_body(body, chat)


def test_check_body_length_inputs():
    assert check_body({"prompt": [1, 2, 3], "max_tokens": 5}, False).prompt_ids == 3
    assert check_body({"prompt": "abc"}, False).max_tokens == 16  # the completions default
    assert check_body({"messages": [{"role": "user", "content": "x"}]}, True).max_tokens is None
    text = check_body({"prompt": "héllo"}, False)
    assert text.upper_bound == 6 + 4 and text.tokenize_body == {"model": None, "prompt": "héllo"}
    assert text.fits(500, 512) is not None and text.fits(496, 512) is None


class _Stack:
    """A fake P (with a fake control server), a fake D and an in-process proxy."""

    def __init__(
        self, d_layout=None, before_decode=None, start_d=True, d_port=0, info_ttl=5.0,
        health_check=None, tokenizer=None,
    ) -> None:
        self.control = FakeControl()
        self.p = FakeEngine("kv_producer")
        self.p.control_port = self.control.port
        self.d_port = d_port or free_port(set())
        self.d_layout = d_layout
        self.d = FakeEngine("kv_consumer", d_layout, port=self.d_port) if start_d else None
        self.d_url = f"http://127.0.0.1:{self.d_port}"
        self.proxy = ServerThread(build_proxy_app([self.p.url], [self.d_url],
                                                  before_decode=before_decode, info_ttl=info_ttl,
                                                  health_check=health_check, tokenizer=tokenizer))
        self.url = self.proxy.url

    def stop(self) -> None:
        self.proxy.stop()
        for e in (self.p, self.d):
            if e is not None:
                e.stop()
        self.control.stop()


@pytest.fixture
def stack():
    s = _Stack()
    yield s
    s.stop()


def _post(url: str, content: bytes | None = None, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=content, timeout=10, **kw)


def test_bad_json_and_bodies_are_400_json_without_a_prefill_leg(stack):
    for raw in (
        b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}',
        b'{"prompt": "\\ud800", "max_tokens": 4}',
        b'{"prompt": "x", "top_p": 1e400}',
        b'{"prompt": "x", "max_tokens": 0}',
    ):
        r = _post(stack.url, raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, raw
        assert r.json()["error"]["type"] == "BadRequestError" and r.json()["error"]["code"] == 400
    assert stack.p.hits["prefill"] == 0 and stack.d.hits["decode"] == 0
    assert (
        _post(stack.url, json={"prompt": "x", "max_tokens": 4}).json()["choices"][0]["text"]
        == "decoded"
    )
    assert stack.p.hits["prefill"] == 1


def test_over_length_is_400_without_a_prefill_leg(stack):
    r = _post(stack.url, json={"prompt": [5] * 500, "max_tokens": 13})  # 513 > 512
    assert r.status_code == 400 and "maximum context length is 512" in r.json()["error"]["message"]
    assert stack.d.hits["tokenize"] == 0  # token ids: counted, not tokenized
    r = _post(stack.url, json={"prompt": "word " * 100, "max_tokens": 413})  # fake D: 100 tokens
    assert (
        r.status_code == 400
        and "(100 in the prompt, 413 for the completion)" in r.json()["error"]["message"]
    )
    assert stack.d.hits["tokenize"] == 1
    assert stack.p.hits["prefill"] == 0
    assert _post(stack.url, json={"prompt": "short", "max_tokens": 8}).status_code == 200
    assert stack.d.hits["tokenize"] == 1  # a short text fits by its byte count alone
    assert _post(stack.url, json={"prompt": "word " * 100, "max_tokens": 412}).status_code == 200
    assert stack.p.hits["prefill"] == 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 512}
    r = httpx.post(stack.url + "/v1/chat/completions", json=chat, timeout=10)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert stack.d.hits["tokenize"] == 3 and stack.p.hits["prefill"] == 2


def test_a_chat_that_cannot_be_too_long_is_not_counted_by_decode(model_path):
    """With the model's chat template (--tokenizer) the proxy bounds a chat prompt by its
    rendered UTF-8 size: a short chat needs no POST /tokenize to D; one whose size cannot rule
    out a refusal is still counted by D and refused with D's 400 before P."""
    s = _Stack(tokenizer=model_path)
    try:
        url = s.url + "/v1/chat/completions"
        short = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8}
        assert httpx.post(url, json=short, timeout=30).status_code == 200
        assert s.d.hits["tokenize"] == 0 and s.p.hits["prefill"] == 1
        # The rendered template (its default system prompt) alone is over 2 bytes: D counts.
        tight = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 508}
        assert httpx.post(url, json=tight, timeout=30).status_code == 200  # fake D: 4 "words"
        assert s.d.hits["tokenize"] == 1 and s.p.hits["prefill"] == 2
        long = {"messages": [{"role": "user", "content": "word " * 100}],
                "max_completion_tokens": 413}  # fake D: 100 words + 413 > 512
        r = httpx.post(url, json=long, timeout=30)
        assert r.status_code == 400 and "maximum context length is 512" in r.text
        assert s.d.hits["tokenize"] == 2 and s.p.hits["prefill"] == 2
    finally:
        s.stop()


def test_layout_mismatch_is_503_on_health_and_requests():
    s = _Stack(d_layout={**LAYOUT, "head_size": 32})
    try:
        h = httpx.get(s.url + "/health", timeout=10)
        assert h.status_code == 503
        message = h.json()["error"]["message"]
        assert (
            "head_size: producer=64 consumer=32" in message
            and s.p.url in message
            and s.d.url in message
        )
        r = _post(s.url, json={"prompt": "x", "max_tokens": 4})
        assert (
            r.status_code == 503
            and "head_size: producer=64 consumer=32" in r.json()["error"]["message"]
        )
        assert s.p.hits["prefill"] == 0
        s.d.layout = dict(LAYOUT)  # D "restarts" with P's layout: the next probe sees it
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        assert _post(s.url, json={"prompt": "x", "max_tokens": 4}).status_code == 200
    finally:
        s.stop()


def test_a_mixed_decode_pool_routes_only_to_engines_that_fit():
    """One good and one mismatched D behind the proxy: /health names the mismatch, but every
    request goes to the D that fits P (none to the other, and no prefill leg is wasted)."""
    control = FakeControl()
    p = FakeEngine("kv_producer")
    p.control_port = control.port
    good = FakeEngine("kv_consumer")
    bad = FakeEngine("kv_consumer", {**LAYOUT, "head_size": 32})
    proxy = ServerThread(build_proxy_app([p.url], [bad.url, good.url]))
    try:
        assert httpx.get(proxy.url + "/health", timeout=10).status_code == 503
        codes = [
            _post(proxy.url, json={"prompt": "x", "max_tokens": 4}).status_code for _ in range(4)
        ]
        assert codes == [200] * 4
        assert good.hits["decode"] == 4 and bad.hits["decode"] == 0 and p.hits["prefill"] == 4
    finally:
        proxy.stop()
        for e in (p, good, bad):
            e.stop()
        control.stop()


def test_a_decode_engine_that_starts_after_the_proxy_is_checked():
    """D is down when the proxy starts: 503 without a prefill leg; once a probe (here /health's)
    finds it up, its layout is checked before anything reaches P."""
    s = _Stack(start_d=False)
    try:
        h = httpx.get(s.url + "/health", timeout=10)
        states = {b["url"]: b for b in h.json()["backends"]}
        assert h.status_code == 503
        assert not states[s.d_url]["healthy"] and states[s.p.url]["healthy"]
        r = _post(s.url, json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and "no healthy decode backend" in r.json()["error"]["message"]
        assert s.p.hits["prefill"] == 0
        s.d = FakeEngine("kv_consumer", {**LAYOUT, "dtype": "bfloat16"}, port=s.d_port)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 503  # the layouts differ
        r = _post(s.url, json={"prompt": "x", "max_tokens": 4})
        assert (
            r.status_code == 503
            and "dtype: producer='float32' consumer='bfloat16'" in r.json()["error"]["message"]
        )
        assert s.p.hits["prefill"] == 0
    finally:
        s.stop()


def test_a_decode_leg_that_finds_d_down_is_502_releases_and_marks_d_unhealthy(caplog):
    """D dies after a probe found it healthy (the next probe is an hour away): the leg that finds
    it down is a 502, logged at WARNING, and P's grant is released; the requests after it get a
    503 before any prefill leg, until a probe finds D back (with no D healthy, each request
    probes first)."""
    s = _Stack(health_check=HealthCheckConfig(interval_s=3600.0))
    try:
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        s.d.stop()
        with caplog.at_level(logging.WARNING, logger="pdkv.router"):
            r = _post(s.url, json={"prompt": "x", "max_tokens": 4},
                      headers={"X-Request-Id": "d-gone"})
        assert r.status_code == 502 and s.p.hits["prefill"] == 1
        assert s.control.got.wait(10) and s.control.notices == [("r-d-gone", "release")]
        [why] = [m for m in caplog.messages if m.startswith("502:")]
        assert f"request d-gone: decode leg to {s.d_url} failed: ConnectError" in why
        r = _post(s.url, json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and s.d_url in r.json()["error"]["message"]
        assert s.p.hits["prefill"] == 1
        assert metric(s.url, "pdkv:proxy_backend_healthy", backend=s.d_url, role="decode") == 0
        assert metric(s.url, "pdkv:proxy_backend_healthy", backend=s.p.url, role="prefill") == 1
        s.d = FakeEngine("kv_consumer", port=s.d_port)  # back (restarted): with no healthy D,
        # a request probes the pool first, so it is used at once
        assert _post(s.url, json={"prompt": "x", "max_tokens": 4}).status_code == 200
    finally:
        s.stop()


def test_requests_skip_a_dead_decode_engine_and_get_503_when_none_is_left():
    """Two D engines, one never started: every request goes to the other; with both gone, the
    proxy answers 503 and P receives no prefill leg."""
    control = FakeControl()
    p = FakeEngine("kv_producer")
    p.control_port = control.port
    live = FakeEngine("kv_consumer")
    dead = f"http://127.0.0.1:{free_port({live.server.port, p.server.port})}"
    proxy = ServerThread(build_proxy_app([p.url], [dead, live.url],
                                         health_check=HealthCheckConfig(interval_s=3600.0)))
    try:
        h = httpx.get(proxy.url + "/health", timeout=10)
        states = {(b["role"], b["url"]): b for b in h.json()["backends"]}
        assert h.status_code == 503 and dead in h.json()["error"]["message"]
        down = states["decode", dead]
        assert not down["healthy"] and "ConnectError" in down["error"]
        assert states["decode", live.url]["healthy"] and states["prefill", p.url]["healthy"]
        codes = [
            _post(proxy.url, json={"prompt": "x", "max_tokens": 4}).status_code for _ in range(6)
        ]
        assert codes == [200] * 6 and live.hits["decode"] == 6 and p.hits["prefill"] == 6
        live.stop()
        assert httpx.get(proxy.url + "/health", timeout=10).status_code == 503
        r = _post(proxy.url, json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        assert "no healthy decode backend" in r.json()["error"]["message"]
        assert p.hits["prefill"] == 6 and control.notices == []
        assert metric(proxy.url, "pdkv:proxy_errors_total", leg="decode", kind="unavailable") == 1
    finally:
        proxy.stop()
        for e in (p, live):
            e.stop()
        control.stop()


def test_a_wrong_role_is_503(stack):
    stack.d.role = "kv_producer"
    h = httpx.get(stack.url + "/health", timeout=10)
    assert h.status_code == 503 and "not a consumer" in h.json()["error"]["message"]


def test_a_layout_mismatch_reported_by_decode_is_503_and_releases(stack):
    """Layouts changed within the proxy's cache window: D's 400 becomes a 503."""
    stack.d.decode_error = (
        400,
        "KV layout mismatch between prefill and decode engines (dtype: ...)",
    )
    r = _post(stack.url, json={"prompt": "x", "max_tokens": 4})
    assert r.status_code == 503 and "KV layout mismatch" in r.json()["error"]["message"]
    assert stack.control.got.wait(10) and stack.control.notices[0][1] == "release"
    stack.d.decode_error = (400, "some other client error")
    assert _post(stack.url, json={"prompt": "x", "max_tokens": 4}).status_code == 400


def test_client_gone_between_the_legs_releases_prefill_blocks():
    """The client disconnects after P answered and before the decode leg: P gets a release for
    exactly that request and D never sees it (forced order: the hook holds the proxy there)."""
    reached = threading.Event()

    async def hold(params):
        reached.set()
        await asyncio.sleep(60)  # cancelled by the disconnect

    s = _Stack(before_decode=hold)
    try:
        body = b'{"prompt": "x", "max_tokens": 4}'
        with socket.create_connection(("127.0.0.1", s.proxy.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: gone-1\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            assert reached.wait(10)
        assert s.control.got.wait(10)
        assert s.control.notices == [("r-gone-1", "release")]
        assert s.d.hits["decode"] == 0
    finally:
        s.stop()


def test_a_hung_decode_engine_is_left_alone_once_a_probe_timed_out():
    """A D that accepts connections and never answers: the probe's timeout marks it unhealthy,
    and requests then go to the other D without asking the hung one anything (no leg, no
    /kv_layout or /v1/models, each of which would wait for its timeout)."""
    control = FakeControl()
    p = FakeEngine("kv_producer")
    p.control_port = control.port
    live, hung = FakeEngine("kv_consumer"), SilentEngine()
    proxy = ServerThread(build_proxy_app(
        [p.url], [hung.url, live.url],
        health_check=HealthCheckConfig(interval_s=3600.0, timeout_s=0.5)))
    try:
        h = httpx.get(proxy.url + "/health", timeout=10)
        states = {b["url"]: b for b in h.json()["backends"]}
        assert h.status_code == 503 and "ReadTimeout" in states[hung.url]["error"]
        seen = len(hung.requests)
        codes = [
            _post(proxy.url, json={"prompt": "x", "max_tokens": 4}).status_code for _ in range(4)
        ]
        assert codes == [200] * 4 and live.hits["decode"] == 4
        assert hung.requests[seen:] == []
    finally:
        proxy.stop()
        for e in (p, live, hung):
            e.stop()
        control.stop()


def test_a_decode_stream_that_breaks_ends_with_an_error_event_and_a_warning(stack, caplog):
    stack.d.stream_break = True
    body = {"prompt": "x", "max_tokens": 4, "stream": True}
    with caplog.at_level(logging.WARNING, logger="pdkv.router"):
        r = _post(stack.url, json=body, headers={"X-Request-Id": "broken-1"})
    assert r.status_code == 200 and '"code": 502' in r.text and r.text.endswith("[DONE]\n\n")
    [why] = [m for m in caplog.messages if "broke after it started" in m]
    assert f"request broken-1: decode stream from {stack.d.url} broke" in why
    assert metric(stack.url, "pdkv:proxy_errors_total", leg="decode", kind="stream") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_pooled_connection_closed_as_a_leg_goes_out_is_retried_not_a_502(stream):
    """Each engine drops the first POST that arrives on a connection it already answered on
    (the keep-alive race): the proxy sends that leg again, so every request succeeds."""
    p, d = KeepAliveRaceEngine(), KeepAliveRaceEngine()
    proxy = ServerThread(build_proxy_app([p.url], [d.url]))
    try:
        for i in range(3):
            r = _post(proxy.url, json={"prompt": "x", "max_tokens": 4, "stream": stream})
            assert r.status_code == 200, (i, r.text)
            assert "decoded" in r.text and "error" not in r.text
        assert p.dropped == 1 and d.dropped == 1  # the race was hit on both legs
        assert p.posts == 3 and d.posts == 3
    finally:
        proxy.stop()
        p.stop()
        d.stop()


def test_client_gone_during_the_prefill_leg_releases_the_grant_p_answers_with():
    """The client disconnects while P is prefilling (forced order: P holds its answer until the
    proxy has counted the disconnect). P finishes and holds the blocks under a grant only its
    answer names: the proxy still reads that answer and releases the grant at once, and D never
    sees the request."""
    s = _Stack()
    s.p.prefill_hold = threading.Event()
    try:
        body = b'{"prompt": "x", "max_tokens": 4}'
        with socket.create_connection(("127.0.0.1", s.proxy.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: gone-2\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            assert s.p.prefill_reached.wait(10)
        deadline = time.monotonic() + 10
        while metric(s.url, "pdkv:proxy_client_disconnects_total", phase="prefill") != 1:
            assert time.monotonic() < deadline, "the proxy did not see the client leave"
            time.sleep(0.05)
        s.p.prefill_hold.set()
        assert s.control.got.wait(10)
        assert s.control.notices == [("r-gone-2", "release")]
        assert s.d.hits["decode"] == 0
    finally:
        s.p.prefill_hold.set()
        s.stop()


def test_no_release_when_decode_answers(stack):
    assert _post(stack.url, json={"prompt": "x", "max_tokens": 4}).status_code == 200
    assert not stack.control.got.wait(0.5)
    assert stack.control.notices == []


def test_an_unexpected_proxy_error_is_500_json_not_text():
    async def boom(params):
        raise RuntimeError("hook failed")

    s = _Stack(before_decode=boom)
    try:
        r = _post(s.url, json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 500
        assert (
            r.json()["error"]["type"] == "InternalServerError"
            and "hook failed" in r.json()["error"]["message"]
        )
        assert s.control.got.wait(10) and s.control.notices[0][1] == "release"
    finally:
        s.stop()


def test_models_tokenize_detokenize_are_forwarded_to_decode(stack):
    models = httpx.get(stack.url + "/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "smollm2"
    tok = httpx.post(stack.url + "/tokenize", json={"prompt": "a b c"}, timeout=10)
    assert tok.status_code == 200 and tok.json()["count"] == 3
    detok = httpx.post(stack.url + "/detokenize", json={"tokens": [5, 7]}, timeout=10)
    assert detok.status_code == 200 and detok.json() == {"prompt": "t5 t7"}
    assert stack.d.hits["tokenize"] == 1 and stack.d.hits["detokenize"] == 1
    assert stack.p.hits["tokenize"] == 0 and stack.p.hits["detokenize"] == 0


def test_a_block_size_difference_pairs_unless_decode_has_dcp():
    """Block size is converted by the P2P connector (re-blocking): P 16 and D 32 pair; a DCP
    decode engine cannot convert it, and the message names both values."""
    from pdkv.router.backend_info import BackendInfo, pair_mismatch

    def info(role: str, **layout: object) -> BackendInfo:
        return BackendInfo(role, "e", {**LAYOUT, **layout}, 512, 0.0, None)

    assert pair_mismatch("p", info("kv_producer"), "d", info("kv_consumer", block_size=32)) is None
    msg = pair_mismatch(
        "p", info("kv_producer"), "d", info("kv_consumer", block_size=32, dcp_size=2)
    )
    assert (
        msg is not None
        and "block_size=32" in msg
        and "block_size=16" in msg
        and "dcp_size=2" in msg
    )
    assert pair_mismatch("p", info("kv_producer"), "d", info("kv_consumer", dcp_size=2)) is None
    # A prefill engine at tp 2 hands over one head slice per rank in whole blocks: neither a
    # block size change nor a DCP decode engine pairs with it (the decode engine's own refusals).
    p_tp2 = info("kv_producer", tp_size=2)
    assert pair_mismatch("p", p_tp2, "d", info("kv_consumer")) is None
    msg = pair_mismatch("p", p_tp2, "d", info("kv_consumer", block_size=32))
    assert (
        msg is not None and "tp_size=2" in msg and "block_size=16" in msg and "block_size=32" in msg
    )
    msg = pair_mismatch("p", p_tp2, "d", info("kv_consumer", dcp_size=2))
    assert msg is not None and "tp_size=2 into a DCP decode engine" in msg


def test_a_block_size_difference_into_a_multi_group_decode_engine_is_known_before_prefill():
    """A decode engine with several KV cache groups (sliding window + full, linear state,
    DeepSeek-V4) refuses to re-block; GET /kv_layout's kv_cache_groups lets the proxy say so
    at /health and before P runs, instead of a 400 from D after P's prefill."""
    from dataclasses import replace

    from pdkv.router.backend_info import BackendInfo, pair_mismatch

    p = BackendInfo("kv_producer", "e", dict(LAYOUT), 512, 0.0, None)
    d = BackendInfo("kv_consumer", "e", {**LAYOUT, "block_size": 8}, 512, 0.0, None,
                    kv_cache_groups=5)
    msg = pair_mismatch("p", p, "d", d)
    assert msg is not None and "re-blocking needs one KV cache group" in msg
    assert "block_size=8" in msg and "block_size=16" in msg and "has 5" in msg
    assert pair_mismatch("p", p, "d", replace(d, kv_cache_groups=1)) is None  # re-blocked
    assert pair_mismatch("p", p, "d", replace(d, layout=dict(LAYOUT))) is None  # equal sizes


def _proxy_errors(url: str) -> dict[tuple[str, str], float]:
    """pdkv:proxy_errors_total by (leg, kind) from the proxy's /metrics."""
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdkv:proxy_errors_total{"):
            labels = dict(
                kv.split("=") for kv in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            out[(labels["leg"].strip('"'), labels["kind"].strip('"'))] = float(
                line.rsplit(" ", 1)[1]
            )
    return out


def test_an_unknown_model_is_404_at_the_proxy_before_any_leg(stack):
    """vLLM's 404 NotFoundError, decided from the backends' /v1/models; counted as the client's
    error, not a proxy or backend failure."""
    for path, body in (
        ("/v1/completions", {"model": "gpt-4", "prompt": "x", "max_tokens": 4}),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ):
        r = httpx.post(stack.url + path, json=body, timeout=10)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and err["code"] == 404 and err["param"] == "model"
        assert (
            f"The model `{body['model']}` does not exist; this deployment serves `smollm2`"
            in err["message"]
        )
    assert (
        stack.p.hits["prefill"] == 0
        and stack.d.hits["decode"] == 0
        and stack.d.hits["tokenize"] == 0
    )
    assert (
        _post(stack.url, json={"model": "smollm2", "prompt": "x", "max_tokens": 4}).status_code
        == 200
    )
    assert (
        _post(stack.url, json={"prompt": "x", "max_tokens": 4}).status_code == 200
    )  # no model: the default
    errors = _proxy_errors(stack.url)
    assert errors.get(("proxy", "client")) == 2
    assert not any(kind == "status" for _, kind in errors)


def test_a_backend_4xx_counts_as_the_clients_error_a_5xx_as_status(stack):
    stack.d.decode_error = (400, "some other client error")
    assert _post(stack.url, json={"prompt": "x", "max_tokens": 4}).status_code == 400
    stack.d.decode_error = (500, "engine failed")
    assert _post(stack.url, json={"prompt": "x", "max_tokens": 4}).status_code == 500
    errors = _proxy_errors(stack.url)
    assert errors.get(("decode", "client")) == 1 and errors.get(("decode", "status")) == 1


def test_unknown_model_needs_a_reported_name_and_error_kind_reads_the_layout():
    from pdkv.router.backend_info import BackendInfo, unknown_model
    from pdkv.router.proxy_protocol import error_kind

    served = BackendInfo(None, None, None, 512, 0.0, model_ids=("smollm2", "alias"))
    silent = BackendInfo(None, None, None, 512, 0.0)
    assert unknown_model("alias", [served, None]) is None
    assert unknown_model(None, [served]) is None
    assert unknown_model("x", [silent, None]) is None  # nothing reported: the engine decides
    assert (
        unknown_model("x", [served, silent])
        == "The model `x` does not exist; this deployment serves `smollm2`, `alias`."
    )
    assert error_kind(404) == "client" and error_kind(503) == "status"
    assert error_kind(400, b'{"error": {"message": "KV layout mismatch (dtype)"}}') == "status"


def test_reset_prefix_cache_goes_to_every_backend_and_reports_each(stack):
    r = httpx.post(
        stack.url + "/reset_prefix_cache", headers={"Authorization": "Bearer k"}, timeout=10
    )
    assert r.status_code == 200, r.text
    assert r.json()["backends"] == [
        {"url": stack.p.url, "role": "prefill", "status": 200, "message": None},
        {"url": stack.d.url, "role": "decode", "status": 200, "message": None}]
    assert stack.p.hits["reset_prefix_cache"] == stack.d.hits["reset_prefix_cache"] == 1
    assert stack.p.reset_auth == stack.d.reset_auth == ["Bearer k"]
    # D has blocks in use: its 409 is the answer, and P's success is still reported.
    stack.d.reset_status = 409
    r = httpx.post(stack.url + "/reset_prefix_cache", timeout=10)
    assert r.status_code == 409
    body = r.json()
    assert [b["status"] for b in body["backends"]] == [200, 409]
    assert "blocks are in use" in body["backends"][1]["message"]
    assert (
        "1 of 2 backends succeeded" in body["error"]["message"]
        and stack.d.url in body["error"]["message"]
    )
    assert stack.p.hits["reset_prefix_cache"] == 2


def test_reset_prefix_cache_reports_an_unreachable_backend_as_502():
    s = _Stack(start_d=False)
    try:
        r = httpx.post(s.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 502
        prefill, decode = r.json()["backends"]
        assert (
            prefill["status"] == 200
            and decode["status"] == 502
            and "unreachable" in decode["message"]
        )
    finally:
        s.stop()


def test_reset_prefix_cache_in_colocated_mode_goes_to_every_instance():
    engines = [FakeEngine(None), FakeEngine(None)]
    proxy = ServerThread(build_proxy_app([], [], backend_urls=[e.url for e in engines]))
    try:
        r = httpx.post(proxy.url + "/reset_prefix_cache", timeout=10)
        assert r.status_code == 200
        assert [(b["role"], b["url"]) for b in r.json()["backends"]] == [
            ("backend", e.url) for e in engines
        ]
        assert [e.hits["reset_prefix_cache"] for e in engines] == [1, 1]
    finally:
        proxy.stop()
        for e in engines:
            e.stop()


def test_health_check_config_refuses_what_is_not_positive():
    for bad in ({"interval_s": 0.0}, {"timeout_s": -1.0}, {"interval_s": float("nan")}):
        with pytest.raises(ValueError, match="must be > 0"):
            HealthCheckConfig(**bad)
    assert HealthCheckConfig(1.0, 0.5) == HealthCheckConfig(interval_s=1.0, timeout_s=0.5)


def test_a_client_gone_while_sending_its_body_is_499_not_an_error():
    """The client disconnects before its body is complete: the proxy answers 499 and counts the
    disconnect (phase "before"), instead of an unhandled ClientDisconnect in the ASGI app."""
    app = build_proxy_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"],
                          health_check=HealthCheckConfig(interval_s=3600.0))
    messages = [{"type": "http.request", "body": b'{"model": "m", "pro', "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type",
                                                                b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
