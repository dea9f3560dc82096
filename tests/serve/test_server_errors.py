"""Bad input gets a 400 with OpenAI's error JSON and the next request succeeds; clients that
disconnect abort their requests and every block returns to the pool."""

from __future__ import annotations

import httpx
import pytest
from conftest import MAX_MODEL_LEN, NUM_KV_BLOCKS
from server_utils import metric_value, wait_for_metric

pytestmark = pytest.mark.slow

GOOD = {"prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {**GOOD, "prompt": ""}, "prompt is empty"),
        (
            "/v1/completions",
            {**GOOD, "prompt": [1] * (MAX_MODEL_LEN + 3)},
            "maximum context length",
        ),
        (
            "/v1/completions",
            {**GOOD, "prompt": [1] * 100, "max_tokens": MAX_MODEL_LEN},
            "maximum context length",
        ),
        ("/v1/completions", {**GOOD, "max_tokens": 0}, "max_tokens must be at least 1"),
        ("/v1/completions", {**GOOD, "top_p": 1.5}, "top_p must be in"),
        ("/v1/completions", {**GOOD, "temperature": -0.5}, "temperature must be >= 0"),
        ("/v1/completions", {**GOOD, "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {**GOOD, "prompt": {"not": "a prompt"}}, "prompt"),
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": [1, 2, 10**9]}, "outside the vocabulary"),
        (
            "/v1/completions",
            {**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools: tool calling is not supported",
        ),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
            "role",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "max_completion_tokens": -1},
            "max_tokens must be at least 1",
        ),
    ],
)
def test_bad_request_is_400_then_server_serves(server, path, body, message):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    ok = httpx.post(server.url + "/v1/completions", json=GOOD, timeout=60)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path, body", [("/v1/completions", {**GOOD, "model": "gpt-4"}),
                                        ("/v1/chat/completions", {**CHAT, "model": "nope"})])
def test_unknown_model_is_404_not_found_then_server_serves(server, path, body):
    """OpenAI and vLLM answer an unknown model with 404 NotFoundError (param "model")."""
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "NotFoundError" and err["code"] == 404 and err["param"] == "model"
    assert f"The model `{body['model']}` does not exist" in err["message"]
    assert httpx.post(server.url + "/v1/completions", json=GOOD, timeout=60).status_code == 200


def test_malformed_json_is_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert "error" in r.json()


# Far more tokens than can be generated while the tests below wait: if abort were broken the
# request would still be running (or would finish as "length"), never counted as "abort".
LONG_MAX_TOKENS = MAX_MODEL_LEN - 32


def _long_stream_body():
    return {"prompt": "Tell me a very long story.", "max_tokens": LONG_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}


def _counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    aborted = metric_value(text, "pdkv:request_success_total", finished_reason="abort")
    return aborted, metric_value(text, "pdkv:generation_tokens_total")


def _assert_aborted_early(url: str, before: tuple[float, float]) -> None:
    assert wait_for_metric(url, "pdkv:num_requests_running", 0) == 0
    assert wait_for_metric(url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS
    aborted, generated = _counters(url)
    assert aborted == before[0] + 1, "the request was not aborted"
    assert generated - before[1] < LONG_MAX_TOKENS / 2, "the generation ran on after the disconnect"


def test_streaming_disconnect_aborts_and_frees_blocks(server):
    assert wait_for_metric(server.url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS
    before = _counters(server.url)
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions",
                                                  json=_long_stream_body()) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                got += 1
            if got >= 3:
                break  # leave mid-generation: closing the response drops the connection
    _assert_aborted_early(server.url, before)


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    assert wait_for_metric(server.url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS
    before = _counters(server.url)
    body = {**_long_stream_body(), "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    _assert_aborted_early(server.url, before)


def test_api_key_required_when_configured():
    from server_utils import RemoteServer

    args = ["serve", "--model", "smollm2", "--num-kv-blocks", "64", "--max-model-len", "256",
            "--api-key", "s3cret"]
    with RemoteServer(args) as srv:
        assert httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=30).status_code == 401
        ok = httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=60,
                        headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        # State-changing routes outside /v1 need the key too.
        assert httpx.post(srv.url + "/reset_prefix_cache", timeout=30).status_code == 401
        reset = httpx.post(srv.url + "/reset_prefix_cache", timeout=30,
                           headers={"Authorization": "Bearer s3cret"})
        assert reset.status_code == 200, reset.text
