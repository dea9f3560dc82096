"""A tiny deterministic OpenAI-compatible SSE server for the `pdkv bench serve` tests.

Every generation request (completions or chat) streams, with known gaps:

    wait 100 ms -> chat: a role-only chunk / completions: an empty-text chunk
    wait  50 ms -> ": ping" SSE comment, then content "a"
    wait  40 ms -> ONE chunk carrying two tokens' text "bc"
    wait  60 ms -> content "d"
    usage chunk (completion_tokens=4, prompt_tokens = whitespace words of the prompt), [DONE]

The "d" chunk carries `pdkv_timings` (TIMINGS: phases queue 20 ms + prefill 100 ms, total
120 ms) unless `MockState.timings` is off.

so TTFT ≈ 150 ms, ITL ≈ [40, 60] ms, E2EL ≈ 250 ms, output tokens 4 (from usage; 3 chunks).
A prompt containing "FAIL" gets HTTP 400. `/tokenize` / `/detokenize` treat each whitespace
word as a token ("w123" <-> id 123; ids >= `vocab_size` are rejected); `/metrics` serves
Prometheus counters that grow by 10 queries, 4 hits and 1000 KV bytes pulled
(`pdkv:kv_transfer_bytes_received_total`) per finished request; `/v1/models` lists "mock-model".
`MockState` switches parts off (tokenize, metrics, usage) and records what came in.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

GAPS_S = (0.100, 0.050, 0.040, 0.060)
CONTENT = ("a", "bc", "d")
COMPLETION_TOKENS = 4
MODEL = "mock-model"
TIMINGS = {
    "source": "engine",
    "unit": "s",
    "total": 0.12,
    "phases": {"queue": 0.02, "prefill": 0.1},
}


@dataclass
class MockState:
    """Switches and records of the mock server (mutated from its event loop thread)."""

    tokenize: bool = True
    strict_tokenize: bool = False  # reject unknown /tokenize fields (add_special_tokens) with 422
    vocab_size: int = 50000  # /detokenize answers 400 for ids at or above it
    metrics: bool = True
    usage: bool = True
    timings: bool = True
    in_flight: int = 0
    max_in_flight: int = 0
    finished: int = 0
    payloads: list[dict[str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    tokenize_bodies: list[dict[str, Any]] = field(default_factory=list)

    def reset(self) -> None:
        """Back to the defaults, records cleared (counters behind /metrics keep growing)."""
        self.tokenize = self.metrics = self.usage = self.timings = True
        self.strict_tokenize = False
        self.vocab_size = 50000
        self.tokenize_bodies.clear()
        self.in_flight = self.max_in_flight = 0
        self.payloads.clear()
        self.auth_headers.clear()


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _word_id(word: str) -> int:
    m = re.fullmatch(r"w(\d+)", word)
    return int(m.group(1)) if m else 50 + len(word)


def create_app(state: MockState) -> Starlette:
    """The Starlette app serving the endpoints described in the module doc."""

    async def generate(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        payload = await request.json()
        state.payloads.append(payload)
        state.auth_headers.append(request.headers.get("authorization"))
        prompt = payload["messages"][-1]["content"] if chat else payload["prompt"]
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "marker prompt rejected"}}, status_code=400)
        prompt_tokens = len(prompt.split())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {"content": text}
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": None}
            return {"id": "x", "object": kind, "model": MODEL, "choices": [choice]}

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            done = False
            try:
                await asyncio.sleep(GAPS_S[0])
                yield _sse(chunk(None, role=True) if chat else chunk(""))
                await asyncio.sleep(GAPS_S[1])
                yield b": ping\n\n"
                yield _sse(chunk(CONTENT[0]))
                await asyncio.sleep(GAPS_S[2])
                yield _sse(chunk(CONTENT[1]))
                await asyncio.sleep(GAPS_S[3])
                last = chunk(CONTENT[2])
                if state.timings:
                    last["pdkv_timings"] = TIMINGS
                yield _sse(last)
                if state.usage:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": COMPLETION_TOKENS,
                             "total_tokens": prompt_tokens + COMPLETION_TOKENS}
                    yield _sse({"id": "x", "object": kind, "choices": [], "usage": usage})
                # Count the request as finished before the client can see [DONE], so a scrape
                # or the next request it triggers already sees the new numbers.
                state.finished += 1
                state.in_flight -= 1
                done = True
                yield b"data: [DONE]\n\n"
            finally:
                if not done:
                    state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def tokenize(request: Request) -> Response:
        if not state.tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await request.json()
        state.tokenize_bodies.append(body)
        if state.strict_tokenize and set(body) - {"model", "prompt"}:
            return JSONResponse({"detail": "extra fields not permitted"}, status_code=422)
        tokens = [_word_id(w) for w in body["prompt"].split()]
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 8192})

    async def detokenize(request: Request) -> Response:
        if not state.tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await request.json()
        if any(int(t) >= state.vocab_size for t in body["tokens"]):
            return JSONResponse({"error": {"message": "token id out of range"}}, status_code=400)
        return JSONResponse({"prompt": " ".join(f"w{int(t)}" for t in body["tokens"])})

    async def metrics(request: Request) -> Response:
        if not state.metrics:
            return PlainTextResponse("not found", status_code=404)
        n = state.finished
        text = (
            "# HELP pdkv:prefix_cache_queries_total Prefix cache queries (tokens).\n"
            "# TYPE pdkv:prefix_cache_queries_total counter\n"
            f'pdkv:prefix_cache_queries_total{{model_name="{MODEL}"}} {10.0 * n + 5}\n'
            "# TYPE pdkv:prefix_cache_hits_total counter\n"
            f'pdkv:prefix_cache_hits_total{{model_name="{MODEL}"}} {4.0 * n + 1}\n'
            "# TYPE pdkv:kv_transfer_bytes_received_total counter\n"
            f"pdkv:kv_transfer_bytes_received_total {1000.0 * n}\n"
            "# TYPE pdkv:num_requests_running gauge\n"
            "pdkv:num_requests_running 0\n"
        )
        return PlainTextResponse(text)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    return Starlette(routes=[
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
    ])


class MockServer:
    """Runs the mock app with uvicorn in a daemon thread on 127.0.0.1 and a free port.

    Use as a context manager; `base_url` is set once it is listening.
    """

    def __init__(self, state: MockState | None = None):
        self.state = state or MockState()
        self.base_url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MockServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self.state), log_level="warning", lifespan="off",
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("mock server did not start")
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=10)
