"""The vLLM P/D proxy protocol's pieces that need no app state: the prefill leg's body, the
error JSON, and releasing a prefill engine's held blocks (see `pdkv.router.proxy`).
(Protocol: vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py.)"""

from __future__ import annotations

import copy
import json
from typing import TypeGuard

from fastapi.responses import JSONResponse

from pdkv.jsontypes import JSONObject, JSONValue


def error_response(
    message: str, status: int, err_type: str, param: str | None = None
) -> JSONResponse:
    """OpenAI's error JSON with HTTP status `status` (`param`: the request field at fault)."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def prefill_body(body: JSONObject) -> JSONObject:
    """The prefill leg's body (see module docstring)."""
    p = copy.deepcopy(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p.pop("min_tokens", None)
    p.pop("min_completion_tokens", None)
    p["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return p


def release_prefill(params: JSONObject) -> bool:
    """Tell the prefill engine named in `params` (P's kv_transfer_params) that its held blocks
    will never be read (blocking, best effort; the lease still bounds the hold). A P at tp > 1
    holds the blocks on every rank: the release goes to each control endpoint in `endpoints`
    (rank order; `remote_host`/`remote_port` is rank 0's). The one place that maps the params
    onto the connector's release helper. Returns whether every rank acknowledged."""
    from pdkv.jsontypes import as_int
    from pdkv.kv_transfer.connector.p2p_messages import send_release

    endpoints = params.get("endpoints") or [[params["remote_host"], params["remote_port"]]]
    if not isinstance(endpoints, list):
        raise TypeError(f"kv_transfer_params.endpoints must be a list, got {endpoints!r:.60}")
    acks = []
    for endpoint in endpoints:  # one at a time: a malformed one stops there, as before
        if not isinstance(endpoint, list):
            raise TypeError(f"an endpoint must be [host, port], got {endpoint!r:.60}")
        host, port = endpoint
        acks.append(send_release(host=str(host), port=as_int(port),
                                 request_id=str(params["remote_request_id"]),
                                 nonce=str(params.get("remote_nonce", ""))))
    return all(acks)


def releasable(params: JSONValue) -> TypeGuard[JSONObject]:
    """Whether P's kv_transfer_params name blocks that can be released."""
    return (
        isinstance(params, dict)
        and bool(params.get("remote_host"))
        and "remote_request_id" in params
    )


def is_layout_error(content: bytes) -> bool:
    """Whether an engine's error body reports a KV layout mismatch."""
    return b"KV layout mismatch" in content


def error_kind(status: int, content: bytes = b"") -> str:
    """The `kind` label (pdkv:proxy_errors_total) of a backend's non-200 answer: "client" for a
    4xx (the request was bad: no proxy or engine failure), except a KV layout mismatch (the
    deployment's fault); else "status"."""
    return "client" if 400 <= status < 500 and not is_layout_error(content) else "status"


def _answer_field(status: int, content: bytes, name: str) -> JSONValue:
    """Field `name` of P's 200 answer (None when absent or unreadable)."""
    if status != 200:
        return None
    try:
        answer = json.loads(content)
        return answer.get(name) if isinstance(answer, dict) else None
    except ValueError:
        return None


def prefill_params(status: int, content: bytes) -> JSONValue:
    """kv_transfer_params of P's 200 answer (None when absent or unreadable)."""
    return _answer_field(status, content, "kv_transfer_params")


def prefill_timings(status: int, content: bytes) -> JSONValue:
    """P's own `pdkv_timings` in its 200 answer (None when absent or unreadable)."""
    return _answer_field(status, content, "pdkv_timings")
