"""`pdkv serve`: OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncLLM.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (stream or not), /tokenize,
/detokenize, /kv_layout, /health, /metrics. Errors use OpenAI's error JSON; a bad request gets 400 and the
server keeps serving; a client that disconnects aborts its request.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdkv.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from pdkv.serve.disconnect import ClientDisconnected, until_done_or_disconnect
from pdkv.serve.handlers import APIError, OpenAIHandlers, PreparedRequest
from pdkv.serve.metrics import ServerMetrics
from pdkv.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """HTTP front-end settings.

    Attributes:
        host: bind address (loopback by default).
        port: TCP port.
        api_key: when set, /v1 routes need `Authorization: Bearer <api_key>`.
        served_model_name: the model id clients use.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str = "smollm2"


def build_app(llm: AsyncLLM, config: ServeConfig, metrics: ServerMetrics) -> FastAPI:
    """The FastAPI app. Starts the engine loop on startup and stops it on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not llm.is_running:
            llm.start()
        yield
        llm.shutdown()

    app = FastAPI(title="pdkv", lifespan=lifespan)
    handlers = OpenAIHandlers(llm, config.served_model_name)
    max_model_len = handlers.max_model_len

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        parts = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg')}")
        return JSONResponse(APIError("; ".join(parts) or "invalid request").body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return JSONResponse(APIError(f"internal error: {e}", 500, "InternalServerError").body(), status_code=500)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        needs_key = config.api_key and request.url.path.startswith("/v1")
        if needs_key and request.headers.get("Authorization") != f"Bearer {config.api_key}":
            err = APIError("invalid or missing API key", 401, "AuthenticationError")
            return JSONResponse(err.body(), status_code=401)
        response: Response = await call_next(request)
        return response

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": config.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pdkv",
            "root": llm.engine.config.model_config.path,
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/kv_layout")
    async def kv_layout() -> dict[str, Any]:
        """This engine's KV role, engine id and cache layout (what a P/D peer must agree on);
        404 when no kv connector is configured."""
        kvt = llm.engine.config.kv_transfer_config
        if kvt is None:
            raise APIError("this engine has no kv connector (no --kv-transfer-config)", 404, "NotFoundError")
        return {"kv_role": kvt.kv_role, "engine_id": kvt.engine_id, "layout": dict(llm.engine.runner.layout)}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        handlers.check_model(req.model)
        tok = llm.engine.tokenizer
        if req.messages is not None:
            try:
                msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
                ids = tok.encode_chat(msgs, req.add_generation_prompt)
            except ValueError as e:
                raise APIError(str(e)) from None
        elif req.prompt is not None:
            ids = tok.encode(req.prompt)
        else:
            raise APIError("give either prompt or messages")
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        handlers.check_model(req.model)
        vocab = llm.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return {"prompt": llm.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        prepared = handlers.prepare_completion(body, raw.headers.get("X-Request-Id"))
        return await _serve(prepared, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        prepared = handlers.prepare_chat(body, raw.headers.get("X-Request-Id"))
        return await _serve(prepared, raw)

    async def _serve(p: PreparedRequest, raw: Request) -> Response:
        if not llm.is_running:
            raise APIError("engine is not running", 503, "ServiceUnavailableError")
        outputs = handlers.outputs(p)
        headers = {"X-Request-Id": p.request_id}
        if p.stream:
            return StreamingResponse(
                handlers.stream_response(p, outputs), media_type="text/event-stream", headers=headers
            )
        body = await _until_done_or_disconnect(handlers.full_response(p, outputs), raw)
        return JSONResponse(body, headers=headers)

    return app


async def _until_done_or_disconnect(coro: Any, raw: Request) -> dict[str, Any]:
    """Await the response body; a client that disconnects first cancels it (which aborts the
    request in the engine)."""
    try:
        result: dict[str, Any] = await until_done_or_disconnect(coro, raw)
    except ClientDisconnected:
        raise APIError("client disconnected", 499, "ClientClosedRequest") from None
    except (ValueError, RequestFailedError, EngineDeadError) as e:
        status = 400 if isinstance(e, ValueError) else 500
        raise APIError(str(e), status, "BadRequestError" if status == 400 else "InternalServerError") from None
    return result


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from pdkv.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None)
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def main(args: argparse.Namespace) -> int:
    """Build the engine and run the server until interrupted."""
    import uvicorn

    from pdkv.engine.arg_utils import EngineArgs
    from pdkv.engine.llm_engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = EngineArgs.from_cli_args(args)
    engine = LLMEngine.from_engine_args(engine_args)
    name = engine.config.model_config.served_model_name
    metrics = ServerMetrics(name)
    llm = AsyncLLM(engine, metrics.observe_step)
    config = ServeConfig(host=args.host, port=args.port, api_key=args.api_key, served_model_name=name)
    app = build_app(llm, config, metrics)
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
