"""TTFT decomposition: an engine's `pdkv_timings`, the proxy's stitching arithmetic (fixed
timestamps), the SSE rewrite, and the proxy in front of fake engines (no model)."""

from __future__ import annotations

import json

import httpx
import pytest

from pdkv.outputs import RequestMetrics
from pdkv.router.proxy import build_proxy_app
from pdkv.router.timings import (
    COLOCATED_PHASES,
    PD_PHASES,
    PROXY_PARTS,
    RequestClock,
    StreamStitcher,
    stitch_response,
)
from pdkv.serve.timings import ENGINE_PHASES, engine_timings
from tests.router.fake_engines import FakeEngine, ServerThread

P_T = {"source": "engine", "unit": "s", "total": 0.5,
       "phases": {"input": 0.01, "queue": 0.04, "kv_wait": 0.0, "prefill": 0.4, "output": 0.05}}
D_T = {"source": "engine", "unit": "s", "total": 0.3,
       "phases": {"input": 0.02, "queue": 0.01, "kv_wait": 0.2, "prefill": 0.06, "output": 0.01}}


def test_engine_phases_add_up_to_the_total():
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=12.0,
                       last_token_time=None, finished_time=None, kv_wait_time=1.25)
    t = engine_timings(9.75, m, 12.125)
    assert t is not None and list(t["phases"]) == list(ENGINE_PHASES)
    assert t["phases"] == {
        "input": 0.25,
        "queue": 0.5,
        "kv_wait": 1.25,
        "prefill": 0.25,
        "output": 0.125,
    }
    assert t["total"] == 2.375 == pytest.approx(sum(t["phases"].values()))
    # No first token: nothing to decompose.
    m.first_token_time = None
    assert engine_timings(9.75, m, 12.0) is None


def test_pd_stitching_arithmetic():
    c = RequestClock(received=100.0, mode="pd", p_sent=100.01, p_done=100.6, p_timings=P_T,
                     d_sent=100.62, d_first=101.0)
    t = c.stitch(D_T)
    ph = t["phases"]
    assert list(ph) == list(PD_PHASES) and t["mode"] == "pd" and t["source"] == "proxy"
    expect = {
        "proxy": 0.01,
        "p_input": 0.01,
        "p_queue": 0.04,
        "p_kv_wait": 0.0,
        "p_prefill": 0.4,
        "p_output": 0.05,
        "p_residual": 0.09,
        "proxy_between": 0.02,
        "d_input": 0.02,
        "d_queue": 0.01,
        "transfer": 0.2,
        "d_first_step": 0.06,
        "d_output": 0.01,
        "d_residual": 0.08,
    }
    assert ph == pytest.approx(expect, abs=1e-6)
    assert t["total"] == pytest.approx(1.0) == pytest.approx(sum(ph.values()))
    assert t["legs"] == {"prefill": P_T, "decode": D_T}


def test_proxy_parts_split_the_proxy_phase_by_the_marked_steps():
    c = RequestClock(received=10.0, mode="pd", p_sent=10.05, p_done=10.5, p_timings=P_T,
                     d_sent=10.5, d_first=11.0)
    c.marks.update({"body": 10.001, "models": 10.002, "route": 10.012, "length": 10.049})
    parts = c.stitch(D_T)["proxy_parts"]
    assert parts == pytest.approx(
        {"body": 0.001, "models": 0.001, "route": 0.01, "length": 0.037, "other": 0.001},
        abs=1e-6)
    # A step not reached (e.g. colocated has no prefill leg to mark apart): 0, the rest "other".
    col = RequestClock(received=0.0, mode="colocated", d_sent=0.2, d_first=0.5)
    col.marks["body"] = 0.05
    assert col.stitch(D_T)["proxy_parts"] == pytest.approx(
        {"body": 0.05, "models": 0.0, "route": 0.0, "length": 0.0, "other": 0.15})
    with pytest.raises(ValueError, match="unknown proxy part"):
        col.mark("other")


def test_skip_prefill_and_colocated_stitching_and_missing_engine_timings():
    c = RequestClock(received=5.0, mode="pd_skip_prefill", d_sent=5.1, d_first=5.5)
    ph = c.stitch(D_T)["phases"]
    assert not any(k.startswith("p_") for k in ph) and "proxy_between" not in ph
    assert ph["proxy"] == pytest.approx(0.1) and ph["d_residual"] == pytest.approx(0.1)
    col = RequestClock(received=5.0, mode="colocated", d_sent=5.1, d_first=5.5).stitch(D_T)
    assert list(col["phases"]) == list(COLOCATED_PHASES) and col["phases"]["kv_wait"] == 0.2
    assert col["phases"]["residual"] == pytest.approx(0.1) and col["legs"] == {"whole": D_T}
    # A backend without pdkv_timings: its whole leg is residual.
    bare = RequestClock(
        received=0.0, mode="pd", p_sent=0.0, p_done=0.5, d_sent=0.5, d_first=0.75
    ).stitch(None)
    assert bare["phases"]["p_residual"] == 0.5 and bare["phases"]["d_residual"] == 0.25
    assert bare["phases"]["transfer"] == 0.0
    with pytest.raises(ValueError):
        RequestClock(received=0.0).stitch(D_T)


def _event(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def test_stream_stitcher_marks_the_first_text_and_rewrites_only_the_timings_event():
    clock = RequestClock(received=0.0, mode="colocated", d_sent=0.0)
    s = StreamStitcher(clock)
    role = _event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    text = _event({"choices": [{"delta": {"content": "hi"}}]})
    later = _event({"choices": [{"delta": {"content": "there"}}]})
    final = _event({"choices": [{"delta": {}, "finish_reason": "stop"}], "pdkv_timings": D_T})
    assert s.feed(role + b": ping\n\n") == role + b": ping\n\n" and clock.d_first is None
    assert s.feed(text[:7]) == b""  # half an event waits for the rest
    assert s.feed(text[7:] + later) == text + later and clock.d_first is not None
    out = s.feed(final[:30]) + s.feed(final[30:] + b"data: [DONE]\n\n")
    head, done = out.split(b"\n\n", 1)[0], out.split(b"\n\n", 1)[1]
    stitched = json.loads(head[len(b"data: "):])["pdkv_timings"]
    assert stitched["source"] == "proxy" and stitched["legs"]["whole"] == D_T
    assert done == b"data: [DONE]\n\n" and s.flush() == b""
    body = json.loads(stitch_response(RequestClock(received=0.0, mode="colocated", d_sent=0.0),
                                      json.dumps({"choices": [], "pdkv_timings": D_T}).encode()))
    assert body["pdkv_timings"]["mode"] == "colocated"
    assert stitch_response(RequestClock(d_sent=0.0), b"not json") == b"not json"


@pytest.fixture
def pd():
    p, d = FakeEngine("kv_producer"), FakeEngine("kv_consumer")
    p.timings, d.timings = P_T, D_T
    srv = ServerThread(build_proxy_app([p.url], [d.url]))
    yield p, d, srv.url
    srv.stop()
    p.stop()
    d.stop()


def _check_pd(t: dict) -> None:
    ph = t["phases"]
    assert t["mode"] == "pd" and list(ph) == list(PD_PHASES)
    for k, v in P_T["phases"].items():
        assert ph["p_" + k] == v
    assert (ph["d_input"], ph["d_queue"], ph["transfer"], ph["d_first_step"], ph["d_output"]) == (
        0.02, 0.01, 0.2, 0.06, 0.01)
    assert sum(ph.values()) == pytest.approx(t["total"], abs=1e-5)
    assert t["legs"] == {"prefill": P_T, "decode": D_T}
    parts = t["proxy_parts"]  # every step of the proxy's own work was marked
    assert list(parts) == list(PROXY_PARTS)
    assert sum(parts.values()) == pytest.approx(ph["proxy"], abs=1e-5)
    assert all(v >= 0 for v in parts.values())


def test_proxy_returns_stitched_timings_non_streamed_and_streamed(pd):
    p, d, url = pd
    body = {"model": "smollm2", "prompt": [1, 2, 3], "max_tokens": 4}
    r = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    _check_pd(r.json()["pdkv_timings"])
    events = []
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=10
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    assert [e["choices"][0]["text"] for e in events] == ["", "decoded", ""]
    assert "pdkv_timings" not in events[1]
    _check_pd(events[-1]["pdkv_timings"])
    assert httpx.get(url + "/backends", timeout=5).json() == {"prefill": [p.url], "decode": [d.url],
                                                              "backends": []}


def test_colocated_proxy_passes_the_engine_timings_through_with_its_own():
    b = FakeEngine(None)
    b.timings = D_T
    srv = ServerThread(build_proxy_app([], [], backend_urls=[b.url]))
    try:
        r = httpx.post(
            srv.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10
        )
        t = r.json()["pdkv_timings"]
        assert t["mode"] == "colocated" and list(t["phases"]) == list(COLOCATED_PHASES)
        assert {k: t["phases"][k] for k in ENGINE_PHASES} == D_T["phases"]
        assert sum(t["phases"].values()) == pytest.approx(t["total"], abs=1e-5)
    finally:
        srv.stop()
        b.stop()
