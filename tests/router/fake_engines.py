"""Fake P/D engines and a fake P control server for proxy tests (no model; threads on loopback)."""

from __future__ import annotations

import asyncio
import json
import socket
import socketserver
import threading
import time
from collections import Counter
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from pdkv.kv_transfer.connector.p2p_messages import Ack, Notify
from pdkv.kv_transfer.wire import WireError, recv_msg, send_msg, start_server, stop_server
from pdkv.ports import free_port

LAYOUT = {"model_digest": "abc", "dtype": "float32", "block_size": 16, "num_layers": 30,
          "num_kv_heads": 3, "head_size": 64, "kv_layout": "NHD"}


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` at url/metrics whose labels include `labels` (0 when
    absent)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


class ServerThread:
    """A uvicorn server for `app` on a thread; `port` 0 = a free one."""

    def __init__(self, app: FastAPI, port: int = 0) -> None:
        self.port = port or free_port(set())
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


class FakeControl:
    """P's control server: acknowledges notices and records them as (request_id, kind)."""

    def __init__(self) -> None:
        self.notices: list[tuple[str, str]] = []
        self.got = threading.Event()
        self.srv = start_server("127.0.0.1", 0, self._serve, "fake-control")
        self.port = self.srv.getsockname()[1]

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    msg = recv_msg(conn, Notify)
                except (WireError, OSError):
                    return
                self.notices.append((msg.request_id, msg.kind))
                self.got.set()
                send_msg(conn, Ack(True))

    def stop(self) -> None:
        stop_server(self.srv)


class FakeEngine:
    """Answers like a P (kv_transfer_params) or a D (text) and counts each route it served.

    Attributes:
        hits: route name -> calls ("prefill", "decode", "tokenize", "detokenize", "kv_layout").
        role, layout: what GET /kv_layout reports (role None: 404, no connector).
        decode_error: (status, message) D answers the decode leg with, if set.
        control_port: where the params say P's control server is (0: none).
        prefill_hold: when set, prefill answers wait until it is set (prefill_reached tells).
        timings: the `pdkv_timings` object its answers carry (None: no such field); a streamed
            decode answer sends "decoded" then a final chunk carrying it.
    """

    def __init__(
        self,
        role: str | None,
        layout: dict[str, Any] | None = None,
        max_model_len: int = 512,
        port: int = 0,
        pool_chunk_size: int | None = None,
    ) -> None:
        self.hits: Counter[str] = Counter()
        self.role = role
        self.layout = dict(layout or LAYOUT)
        self.max_model_len = max_model_len
        self.decode_error: tuple[int, str] | None = None
        self.control_port = 0
        self.prefill_hold: threading.Event | None = None  # set: prefill answers wait for it
        self.prefill_reached = threading.Event()
        self.pool_chunk_size = pool_chunk_size
        self.decode_params: list[Any] = []  # kv_transfer_params of every decode request, in order
        self.timings: dict[str, Any] | None = None
        self.reset_status = 200  # what POST /reset_prefix_cache answers
        self.stream_break = False  # set: a streamed decode answer breaks after its first chunk
        self.reset_auth: list[str | None] = []  # the Authorization header of each reset
        app = FastAPI()

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def completions(req: Request) -> Any:
            body = await req.json()
            params = body.get("kv_transfer_params") or {}
            if params.get("do_remote_decode"):
                self.hits["prefill"] += 1
                if self.prefill_hold is not None:
                    self.prefill_reached.set()
                    await asyncio.to_thread(self.prefill_hold.wait, 30)
                answer = {
                    "choices": [{"text": "x"}],
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "remote_request_id": "r-" + req.headers["X-Request-Id"],
                        "remote_host": "127.0.0.1" if self.control_port else None,
                        "remote_port": self.control_port,
                    },
                }
                if self.timings is not None:
                    answer["pdkv_timings"] = self.timings
                return answer
            self.hits["decode"] += 1
            self.decode_params.append(body.get("kv_transfer_params"))
            if self.decode_error:
                status, message = self.decode_error
                return JSONResponse(
                    {
                        "error": {
                            "message": message,
                            "type": "BadRequestError",
                            "param": None,
                            "code": status,
                        }
                    },
                    status_code=status,
                )
            if body.get("stream"):
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            answer = {"choices": [{"text": "decoded"}]}
            if self.timings is not None:
                answer["pdkv_timings"] = self.timings
            return answer

        @app.post("/tokenize")
        async def tokenize(req: Request) -> Any:
            body = await req.json()
            self.hits["tokenize"] += 1
            n = len(str(body.get("prompt") or body.get("messages")).split())
            return {"count": n, "max_model_len": self.max_model_len}

        @app.post("/detokenize")
        async def detokenize(req: Request) -> Any:
            body = await req.json()
            self.hits["detokenize"] += 1
            return {"prompt": " ".join(f"t{t}" for t in body.get("tokens", []))}

        @app.get("/kv_layout")
        async def kv_layout() -> Any:
            self.hits["kv_layout"] += 1
            if self.role is None:
                return JSONResponse({"error": {"message": "no kv connector"}}, status_code=404)
            return {"kv_role": self.role, "engine_id": "e-" + self.role, "layout": self.layout,
                    "pool_chunk_size": self.pool_chunk_size}

        @app.get("/v1/models")
        async def models() -> Any:
            return {
                "object": "list",
                "data": [{"id": "smollm2", "max_model_len": self.max_model_len}],
            }

        @app.get("/health")
        async def health() -> Any:
            return {}

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(req: Request) -> Any:
            self.hits["reset_prefix_cache"] += 1
            self.reset_auth.append(req.headers.get("authorization"))
            if self.reset_status != 200:
                return JSONResponse(
                    {
                        "error": {
                            "message": "prefix cache not reset: KV cache blocks are in use",
                            "type": "ConflictError",
                            "param": None,
                            "code": self.reset_status,
                        }
                    },
                    status_code=self.reset_status,
                )
            return JSONResponse(None, status_code=200)

        self.server = ServerThread(app, port)
        self.url = self.server.url

    async def _stream(self) -> Any:
        yield b'data: {"choices": [{"index": 0, "text": "", "finish_reason": null}]}\n\n'
        if self.stream_break:
            raise RuntimeError("the engine broke the stream")
        yield b'data: {"choices": [{"index": 0, "text": "decoded", "finish_reason": null}]}\n\n'
        final: dict[str, Any] = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
        if self.timings is not None:
            final["pdkv_timings"] = self.timings
        text = f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"
        yield text[:20].encode()  # an event split across two reads
        yield text[20:].encode()

    def stop(self) -> None:
        self.server.stop()


class KeepAliveRaceEngine:
    """A fault-injecting engine on a raw HTTP/1.1 keep-alive server: the first POST that arrives
    on a connection which already served a request is read and then dropped unanswered (the
    connection closed), as when an engine's server closes an idle keep-alive connection just as
    the proxy sends a request on it. Every other request is answered: GET /health, /v1/models,
    /kv_layout (404: no connector) and POSTs (a prefill leg gets kv_transfer_params naming no
    control server; a decode leg gets "decoded", streamed when asked).

    Attributes:
        dropped: POSTs dropped (at most 1).
        posts: POSTs answered.
    """

    def __init__(self) -> None:
        self.dropped = 0
        self.posts = 0
        self._lock = threading.Lock()
        engine = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                served = 0
                while True:
                    request = self.rfile.readline()
                    if not request:
                        return
                    method, path = request.decode().split()[:2]
                    length = 0
                    while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                        name, _, value = line.decode().partition(":")
                        if name.strip().lower() == "content-length":
                            length = int(value)
                    body = self.rfile.read(length) if length else b""
                    if method == "POST" and served and engine._drop():
                        return  # closes the connection without an answer
                    self.wfile.write(engine._answer(method, path, body))
                    served += 1

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _drop(self) -> bool:
        with self._lock:
            if self.dropped:
                return False
            self.dropped += 1
            return True

    def _answer(self, method: str, path: str, body: bytes) -> bytes:
        status, kind = "200 OK", "application/json"
        data: Any = {}
        if path == "/kv_layout":
            status, data = "404 Not Found", {"error": {"message": "no kv connector"}}
        elif path == "/v1/models":
            data = {"object": "list", "data": [{"id": "smollm2", "max_model_len": 512}]}
        elif method == "POST":
            with self._lock:
                self.posts += 1
            request = json.loads(body)
            params = request.get("kv_transfer_params") or {}
            if params.get("do_remote_decode"):
                data = {"choices": [{"text": "x"}], "kv_transfer_params": {
                    "do_remote_prefill": True, "remote_request_id": "r", "remote_host": None}}
            elif request.get("stream"):
                kind = "text/event-stream"
                chunk = {"choices": [{"index": 0, "text": "decoded", "finish_reason": "length"}]}
                data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
            else:
                data = {"choices": [{"text": "decoded"}]}
        payload = (data if isinstance(data, str) else json.dumps(data)).encode()
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(payload)}\r\n"
                "Connection: keep-alive\r\n\r\n")
        return head.encode() + payload

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SilentEngine:
    """An engine that hangs: it accepts connections and reads requests but never answers.

    Attributes:
        requests: request lines received (e.g. "GET /health"), in order.
    """

    def __init__(self) -> None:
        self.requests: list[str] = []
        engine = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while line := self.rfile.readline():
                    if line[:1].isalpha() and b" HTTP/" in line:
                        engine.requests.append(" ".join(line.decode().split()[:2]))

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
