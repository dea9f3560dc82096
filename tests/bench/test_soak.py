"""`pdkv bench soak`: its workload, answer assembly, greedy comparison at near ties, the checks
(each one made to fail on purpose), and the short form on real processes (CI)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from pdkv.bench.soak.checks import (
    GreedyTally,
    Limits,
    Reference,
    compare_greedy,
    failures,
    rss_slopes,
    scan_log,
    slope_pct_per_hour,
)
from pdkv.bench.soak.cli import wait_idle
from pdkv.bench.soak.client import CANCELLED, TRANSPORT, Outcome, Tally, status_class
from pdkv.bench.soak.workload import (
    CHOICES,
    Answer,
    Item,
    SoakRequest,
    divergence,
    make_items,
    next_request,
    request_body,
    structured_ok,
    token_gaps,
)


def test_items_are_seeded_and_mixed():
    a = make_items(3, 24, 0.5, 100, 16)
    assert a == make_items(3, 24, 0.5, 100, 16)
    assert {i.api for i in a} == {"chat", "completions"}
    assert {i.structured for i in a} == {"", "choice", "json"}
    longs = [i.prompt for i in a if len(i.prompt.split(" ")) >= 100]
    shared = " ".join(next(p for p in longs if not p.startswith("Name")).split(" ")[:75])
    assert len(longs) >= 6 and all(shared in p for p in longs)  # a shared prefix
    assert all(4 <= i.max_tokens <= 16 for i in a) and len({i.key for i in a}) == 24
    with pytest.raises(ValueError):
        make_items(0, 0, 0.1, 40, 16)


def test_request_stream_mixes_targets_and_keeps_n_on_colocated():
    items = make_items(0, 12, 0.2, 40, 16)
    rng = random.Random(5)
    reqs = [next_request(rng, items, 0.1, 0.4, 2.0) for _ in range(600)]
    assert {r.target for r in reqs} == {"pd", "colocated"}
    assert any(r.n > 1 for r in reqs)
    assert all(r.target == "colocated" and not r.greedy for r in reqs if r.n > 1)
    cancels = [r.cancel_after for r in reqs if r.cancel_after is not None]
    assert 30 < len(cancels) < 100 and all(0.05 <= c <= 2.0 for c in cancels)
    assert all(r.seed is None for r in reqs if r.greedy)


def test_bodies():
    chat = Item("1-chat-json", "chat", "hi", 8, "json")
    body = request_body(SoakRequest(chat, "pd", stream=True, greedy=True), "m")
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["temperature"] == 0.0 and body["stream"] is True
    assert body["response_format"]["type"] == "json_schema"
    ref = request_body(SoakRequest(chat, "pd", stream=True, greedy=True), "m", reference=True)
    assert ref["stream"] is False and ref["logprobs"] is True and ref["top_logprobs"] == 2
    comp = Item("0-completions-choice", "completions", "x", 8, "choice")
    body = request_body(SoakRequest(comp, "colocated", False, False, n=3, seed=7), "m")
    assert body["prompt"] == "x" and body["n"] == 3 and body["seed"] == 7
    assert body["guided_choice"] == list(CHOICES) and body["temperature"] == 0.8
    assert request_body(SoakRequest(comp, "pd", False, True), "m", reference=True)["logprobs"] == 2


def test_answer_from_stream_chunks_by_index_and_error_event():
    a = Answer("chat")
    for i, part in ((0, "Hel"), (1, "A"), (0, "lo"), (1, "B")):
        a.add_chunk({"choices": [{"index": i, "delta": {"content": part}, "finish_reason": None}]})
    a.add_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    a.add_chunk({"choices": [], "usage": {"completion_tokens": 4}})
    assert a.texts == {0: "Hello", 1: "AB"} and a.finish == {0: "stop", 1: None}
    assert not a.error
    a.add_chunk({"error": {"message": "boom", "code": 500}})
    assert "boom" in a.error
    w = Answer("completions")
    w.add_response({"choices": [{"index": 0, "text": "x y", "finish_reason": "length"}]})
    assert w.texts == {0: "x y"} and w.finish == {0: "length"}


def test_token_gaps_of_both_apis():
    chat = {"choices": [{"logprobs": {"content": [
        {"token": "A", "logprob": -0.1, "top_logprobs": [{"token": "A", "logprob": -0.1},
                                                         {"token": "B", "logprob": -2.1}]},
        {"token": "!", "logprob": 0.0, "top_logprobs": [{"token": "!", "logprob": 0.0}]}]}}]}
    gaps = token_gaps("chat", chat)
    assert gaps[0][0] == "A" and gaps[0][1] == pytest.approx(2.0) and gaps[1][1] == math.inf
    comp = {"choices": [{"text": " a b", "logprobs": {
        "tokens": [" a", " b"], "top_logprobs": [{" a": -0.5, " c": -0.504}, {" b": -1.0}]}}]}
    gaps = token_gaps("completions", comp)
    assert [g[0] for g in gaps] == [" a", " b"] and gaps[0][1] == pytest.approx(0.004)
    with pytest.raises(ValueError):
        token_gaps("chat", {"choices": [{"message": {"content": "x"}}]})


def test_divergence_names_the_first_token_that_differs():
    tokens = [(" the", 3.0), (" red", 0.002), (" fox", 1.0)]
    assert divergence(" the red fox", tokens, " the red fox") is None
    d = divergence(" the red fox", tokens, " the blue fox")
    assert d is not None and d.token == 1 and d.gap == 0.002
    d = divergence(" the red fox", tokens, " the red fog")
    assert d is not None and d.token == 2 and d.gap == 1.0
    d = divergence(" the red fox", tokens, " the red fox and more")
    assert d is not None and d.token == 3 and d.gap == math.inf


def _outcome(req: SoakRequest, status: int, texts: dict[int, str] | None = None,
             finish: str | None = "length") -> Outcome:
    answer = None
    if texts is not None:
        answer = Answer(req.item.api)
        answer.texts = dict(texts)
        answer.finish = {i: finish for i in texts}
    return Outcome(req, status, 0.0, 1.0, answer)


def test_greedy_comparison_excuses_only_near_ties():
    item = Item("0-completions", "completions", "p", 3)
    refs = {item.key: Reference(" the red fox", [(" the", 3.0), (" red", 0.002), (" fox", 1.0)])}
    req = SoakRequest(item, "pd", False, True)
    outcomes = [_outcome(req, 200, {0: " the red fox"}), _outcome(req, 200, {0: " the blue x"}),
                _outcome(req, 200, {0: " the red fog"}), _outcome(req, CANCELLED),
                _outcome(SoakRequest(item, "pd", False, False), 200, {0: "sampled"})]
    t = compare_greedy(outcomes, refs, tie_margin=0.01)
    assert (t.compared, t.equal, t.near_ties, t.wrong_count) == (3, 1, 1, 1)
    assert "fog" in t.wrong[0]
    strict = compare_greedy(outcomes, refs, tie_margin=0.0)
    assert strict.wrong_count == 2 and strict.near_ties == 0


def test_structured_answers_are_checked():
    choice = Item("k", "chat", "p", 8, "choice")
    js = Item("j", "chat", "p", 8, "json")
    assert structured_ok(choice, "red", "stop") and not structured_ok(choice, "purple", "stop")
    assert structured_ok(choice, "gre", "length") and not structured_ok(choice, "x", "length")
    assert structured_ok(js, '{"colour": "blue"}', "stop")
    assert not structured_ok(js, '{"colour": "pink"}', "stop")
    assert not structured_ok(js, '{"colour": "blue", "x": 1}', "stop")
    assert not structured_ok(js, '{"colour": ', "stop") and structured_ok(js, '{"col', "length")


def test_slope():
    ts = [0.0, 1800.0, 3600.0]
    assert slope_pct_per_hour(ts, [100.0, 105.0, 110.0]) == pytest.approx(10.0 / 105.0 * 100)
    assert slope_pct_per_hour(ts, [7.0, 7.0, 7.0]) == 0.0
    with pytest.raises(ValueError):
        slope_pct_per_hour([1.0], [1.0])
    samples = [{"t": float(t), "a.rss_bytes": 1000.0 + (t if t >= 600 else 5 * t)}
               for t in range(0, 1300, 100)]
    slopes, window = rss_slopes(samples, ["a"], Limits(warmup_s=600.0))
    assert window == 600.0 and slopes["a"] == pytest.approx(3600 / 1900 * 100, rel=1e-6)


def _failures(**over: object) -> list[str]:
    args: dict[str, object] = dict(
        tally_status={"ok": 10, "cancelled": 2},
        greedy=GreedyTally(compared=5, equal=5),
        structured=[],
        blocks_start={"decode": 64.0},
        blocks_end={"decode": 64.0},
        idle_start={"decode.fds": 20.0},
        idle_end={"decode.fds": 30.0},
        names=["decode"],
        slopes={"decode": 4.0},
        window_s=900.0,
        limits=Limits(fd_slack=16, max_rss_slope_pct_per_h=5.0, min_slope_window_s=600.0),
    )
    args.update(over)
    return failures(**args)


def test_each_check_fails_on_its_own():
    assert _failures() == []
    assert "server errors" in _failures(tally_status={"ok": 3, "5xx": 1})[0]
    assert "server errors" in _failures(tally_status={"ok": 3, "stream_error": 1})[0]
    assert "server errors" in _failures(tally_status={"ok": 3, "no_answer": 1})[0]
    # The first failed request is quoted once, on the first line it belongs to.
    both = _failures(tally_status={"ok": 3, "no_answer": 1, "4xx": 1}, first_failed="pd/x")
    assert both[0].endswith("; first: pd/x") and "first" not in both[1]
    assert _failures(tally_status={"ok": 3, "4xx": 1}, first_failed="pd/x")[0].endswith("pd/x")
    assert "4xx" in _failures(tally_status={"ok": 3, "4xx": 2})[0]
    assert "no greedy" in _failures(greedy=GreedyTally())[0]
    assert "differ" in _failures(greedy=GreedyTally(compared=2, equal=1, wrong_count=1))[0]
    assert "grammar" in _failures(structured=["k choice 0 (stop): 'x'"])[0]
    assert "free blocks" in _failures(blocks_end={"decode": 60.0})[0]
    assert "open fds" in _failures(idle_end={"decode.fds": 37.0})[0]
    assert "not read" in _failures(idle_end={})[0]
    assert "RSS grows" in _failures(slopes={"decode": 6.0})[0]
    assert _failures(slopes={"decode": 60.0}, window_s=100.0) == []  # too short to judge


def test_tally_and_status_classes():
    item = Item("0-chat-choice", "chat", "p", 4, "choice")
    t = Tally()
    t.add(_outcome(SoakRequest(item, "colocated", True, False, n=2, cancel_after=1.0), CANCELLED))
    t.add(_outcome(SoakRequest(item, "pd", False, True), 502))
    assert t.by_status == {"cancelled": 1, "5xx": 1} and t.finished == 2
    assert t.by_kind["n>1"] == 1 and t.by_kind["structured"] == 2
    assert t.by_kind["cancel planned"] == 1 and t.by_kind["pd/chat/whole/greedy"] == 1
    assert [status_class(s) for s in (200, 404, 0, 599)] == ["ok", "4xx", "no_answer",
                                                            "stream_error"]
    lost = Outcome(SoakRequest(item, "pd", True, True, n=1), TRANSPORT, 105.0, 105.25,
                   error="RemoteProtocolError: Server disconnected")
    assert lost.describe(t0=100.0) == {
        "kind": "pd/chat/stream/greedy", "item": "0-chat-choice", "n": 1, "structured": "choice",
        "cancel_after_s": None, "status": "no_answer", "http_status": 0,
        "error": "RemoteProtocolError: Server disconnected", "sent_at_s": 5.0, "elapsed_s": 0.25}


def test_scan_log(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        "2026-12-03 18:36:10,794 WARNING pdkv.router.proxy: 502: leg to 127.0.0.1:4001 failed\n"
        "2026-12-03 18:36:11,794 WARNING pdkv.router.proxy: 502: leg to 127.0.0.1:4002 failed\n"
        "2026-12-03 18:36:12,000 INFO pdkv.serve: fine\n"
        "2026-12-03 18:36:13,000 ERROR pdkv.serve: bad\n"
        "Traceback (most recent call last):\n  File \"x\", line 1\nValueError: x\n")
    found = scan_log(str(log))
    assert (found.warnings, found.errors, found.tracebacks) == (2, 1, 1)
    assert found.messages["pdkv.router.proxy: # leg to # failed"] == 2
    assert scan_log(str(tmp_path / "missing.log")).warnings == 0


@pytest.mark.slow
def test_soak_short_form(tmp_path):
    """The CI form: ~30 s of load on real processes (P/D + redis pool, colocated), all checks
    but the RSS slope (its window is too short) judged."""
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "bench", "soak", "--duration", "30",
         "--concurrency", "16", "--num-items", "12", "--long-words", "300",
         "--max-model-len", "1024", "--num-kv-blocks", "512", "--warmup", "10",
         "--sample-interval", "2", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=420)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "soak: passed" in out.stdout, text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failures"] == [] and summary["failed_requests"] == [], text
    assert summary["by_status"]["ok"] >= 30, text
    assert summary["greedy"]["compared"] >= 10 and summary["greedy"]["wrong"] == 0, text
    kinds = summary["by_kind"]
    assert kinds.get("n>1", 0) > 0 and kinds.get("structured", 0) > 0, text
    for target in ("pd", "colocated"):
        assert any(k.startswith(target + "/") and "/stream/" in k for k in kinds), text
    assert summary["free_blocks_end"] == summary["free_blocks_start"], text
    assert summary["rss_slope_judged"] is False and summary["samples"] >= 5, text
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) >= 5


class _Rows:
    """A sampler that answers a fixed sequence of samples (the last one repeated)."""

    def __init__(self, rows: list[dict[str, float]]) -> None:
        self.rows = rows
        self.taken = 0

    def sample(self, client: object) -> dict[str, float]:
        self.taken += 1
        return self.rows[min(self.taken, len(self.rows)) - 1]


def test_the_idle_end_waits_for_the_loads_connections_to_close():
    """Right after the load the colocated engine and its proxy still hold the load's keep-alive
    connections (the third hour's 12 -> 41 and 10 -> 38 fds, two seconds after it ended): the
    idle end is the first idle sample whose fds are back within the slack; a leak, whose fds
    never come back, is the sample at the deadline."""
    idle = {"colocated.free_blocks": 64.0, "colocated.running": 0.0}
    busy = dict(idle, **{"colocated.free_blocks": 60.0, "colocated.running": 1.0,
                         "colocated.fds": 70.0})
    rows = [busy, dict(idle, **{"colocated.fds": 41.0}), dict(idle, **{"colocated.fds": 13.0})]
    sampler = _Rows(rows)
    got = wait_idle(sampler, {"colocated": "u"}, 64, timeout=30.0, fds_limit={"colocated": 28.0})
    assert got["colocated.fds"] == 13.0 and sampler.taken == 3
    assert wait_idle(_Rows(rows), {"colocated": "u"}, 64, timeout=30.0)["colocated.fds"] == 41.0
    leak = _Rows([dict(idle, **{"colocated.fds": 41.0})])
    got = wait_idle(leak, {"colocated": "u"}, 64, timeout=0.6, fds_limit={"colocated": 28.0})
    assert got["colocated.fds"] == 41.0 and leak.taken >= 2
