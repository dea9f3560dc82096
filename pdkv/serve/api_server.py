"""`pdkv serve`: OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncLLM.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (stream or not), /tokenize,
/detokenize, /kv_layout, /kv_events, /health, /metrics, POST /reset_prefix_cache. Errors use
OpenAI's error JSON; a bad request gets 400 and the server keeps serving; a client that
disconnects aborts its request. When the engine dies (a step raised), /health and every
request answer 503, in-flight requests end with an error, and the server exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdkv.engine.async_llm import AsyncLLM, EngineDeadError, StepObserver
from pdkv.keepalive import SERVER_KEEPALIVE_S
from pdkv.kv_events.base import KVEventsInfo
from pdkv.outputs import RequestOutput
from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from pdkv.serve.disconnect import ClientDisconnected, until_done_or_disconnect
from pdkv.serve.handlers import APIError, OpenAIHandlers, PreparedRequest
from pdkv.serve.kv_push import add_push_routes, engine_push_block_sizes, transfer_mode
from pdkv.serve.metrics import ServerMetrics
from pdkv.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    KVHeldRequest,
    TokenizeRequest,
)
from pdkv.serve.response_json import ChatCompletionResponse, CompletionResponse
from pdkv.serve.stats_log import DEFAULT_STATS_INTERVAL_S, RequestLogger, StatsLogger
from pdkv.tokenizer import TokenizerPool

if TYPE_CHECKING:
    from pdkv.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """HTTP front-end settings.

    Attributes:
        host: bind address (loopback by default).
        port: TCP port.
        api_key: when set, /v1 routes and /reset_prefix_cache need
            `Authorization: Bearer <api_key>`.
        served_model_name: the model id clients use (the one reported).
        extra_model_names: more ids requests may name (`--served-model-name A B ...`).
        tokenizer_threads: threads (each with its own tokenizer) that tokenize prompts.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str = "smollm2"
    tokenizer_threads: int = 2
    extra_model_names: tuple[str, ...] = ()


# Paths outside /v1 that change engine state: they need the API key too, when one is set.
_KEYED_PATHS = frozenset({"/reset_prefix_cache"})

# Longest wait (s) for the engine loop to run a reset_prefix_cache command.
RESET_PREFIX_CACHE_TIMEOUT_S = 10.0

# Test-only fault injection: the engine step numbered N (1-based) raises.
FAULT_STEP_ENV = "PDKV_FAULT_STEP_RAISE_AT"


class ModelCard(TypedDict):
    """One entry of GET /v1/models (`created`: Unix time, s; `root`: the model folder)."""

    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(TypedDict):
    """GET /v1/models: a card per served name, the reported one first."""

    object: str
    data: list[ModelCard]


class KVLayoutInfo(TypedDict):
    """GET /kv_layout (`pool_chunk_size` in tokens, None without a KV pool; `transfer_mode`
    "push" | "pull"; `push_block_sizes` "any" when the engine pushes across block sizes, else
    "equal"; `kv_cache_groups`: how many KV cache groups the engine has)."""

    kv_role: str
    engine_id: str
    layout: Mapping[str, object]
    pool_chunk_size: int | None
    transfer_mode: str
    push_block_sizes: str
    kv_cache_groups: int


class TokenizeResponse(TypedDict):
    """POST /tokenize (`count` and `max_model_len` in tokens)."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(TypedDict):
    """POST /detokenize."""

    prompt: str


class SafeJSONResponse(JSONResponse):
    """JSONResponse that escapes non-ASCII, so no string (not even one holding a lone
    surrogate) can make rendering fail."""

    def render(self, content: object) -> bytes:
        return json.dumps(
            content, ensure_ascii=True, allow_nan=False, separators=(",", ":")
        ).encode("ascii")


def pool_chunk_size(kv_connector: str, extra: object) -> int | None:
    """Tokens per KV pool chunk of a connector config (a KVPoolConnector, or one among a
    MultiConnector's `connectors`), None when there is no pool; the proxy cuts prompts the same
    way (GET /kv_layout's `pool_chunk_size`). `extra` is the connector's
    kv_connector_extra_config (anything but a dict counts as empty)."""
    from pdkv.kv_transfer.connector.pool_config import PoolConnectorConfig

    todo: list[tuple[object, object]] = [(kv_connector, extra)]
    while todo:
        name, ex = todo.pop(0)
        ex = ex if isinstance(ex, dict) else {}
        if name == "KVPoolConnector":
            return int(ex.get("chunk_size", PoolConnectorConfig.chunk_size))
        if name == "MultiConnector":
            todo += [(c.get("kv_connector"), c.get("kv_connector_extra_config"))
                     for c in ex.get("connectors", []) if isinstance(c, dict)]
    return None


def build_app(llm: AsyncLLM, config: ServeConfig, metrics: ServerMetrics) -> FastAPI:
    """The FastAPI app. Starts the engine loop on startup and stops it on shutdown."""
    tokenizers = TokenizerPool(llm.engine.config.model_config.path, config.tokenizer_threads)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not llm.is_running:
            llm.start()
        # Gauges (free blocks, ...) are right before the first request, too.
        stats = await asyncio.to_thread(llm.call, lambda engine: engine.scheduler.stats())
        metrics.observe_step([], stats, time.monotonic())
        yield
        tokenizers.shutdown()
        llm.shutdown()

    app = FastAPI(title="pdkv", lifespan=lifespan, default_response_class=SafeJSONResponse)
    handlers = OpenAIHandlers(
        llm, config.served_model_name, tokenizers, aliases=config.extra_model_names
    )
    max_model_len = handlers.max_model_len

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return SafeJSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        parts, params = [], []
        for err in e.errors():
            where = [x for x in err.get("loc", ()) if x != "body"]
            loc = ".".join(str(x) for x in where)
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
            if where and isinstance(where[0], str):
                params.append(where[0])
        # OpenAI's `param`: the top-level field of the first error, e.g. "guided_choice".
        error = APIError("; ".join(parts) or "invalid request", param=params[0] if params else None)
        return SafeJSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # Unparsable bodies (e.g. invalid UTF-8), unknown routes, wrong methods: OpenAI's JSON.
        err_type = "BadRequestError" if e.status_code == 400 else "HTTPError"
        body = APIError(str(e.detail), e.status_code, err_type).body()
        return SafeJSONResponse(body, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        body = APIError(f"internal error: {e}", 500, "InternalServerError").body()
        return SafeJSONResponse(body, status_code=500)

    @app.middleware("http")
    async def _auth(request: Request,
                    call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        path = request.url.path
        needs_key = config.api_key and (path.startswith("/v1") or path in _KEYED_PATHS)
        if needs_key and request.headers.get("Authorization") != f"Bearer {config.api_key}":
            err = APIError("invalid or missing API key", 401, "AuthenticationError")
            return SafeJSONResponse(err.body(), status_code=401)
        response: Response = await call_next(request)
        return response

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running and llm.engine.workers_alive() else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # response_model=None: the body as built (FastAPI's jsonable_encoder, no pydantic model).
    @app.get("/v1/models", response_model=None)
    async def models() -> ModelList:
        """One card per served name, the reported one first."""
        cards: list[ModelCard] = [{
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pdkv",
            "root": llm.engine.config.model_config.path,
            "max_model_len": max_model_len,
        } for name in (config.served_model_name, *config.extra_model_names)]
        return {"object": "list", "data": cards}

    @app.get("/kv_layout", response_model=None)
    async def kv_layout() -> KVLayoutInfo:
        """This engine's KV role, engine id and cache layout (what a P/D peer must agree on) and
        its KV pool's chunk size (None without a pool); 404 when no kv connector is configured."""
        kvt = llm.engine.config.kv_transfer_config
        if kvt is None:
            raise APIError(
                "this engine has no kv connector (no --kv-transfer-config)", 404, "NotFoundError"
            )
        return {
            "kv_role": kvt.kv_role,
            "engine_id": kvt.engine_id,
            "layout": llm.engine.executor.kv_layout.to_wire(),
            "pool_chunk_size": pool_chunk_size(kvt.kv_connector, kvt.kv_connector_extra_config),
            "transfer_mode": transfer_mode(kvt.kv_connector, kvt.kv_connector_extra_config),
            "push_block_sizes": engine_push_block_sizes(llm),
            "kv_cache_groups": len(llm.engine.executor.kv_cache_config.groups),
        }

    add_push_routes(app, llm)

    @app.get("/kv_events", response_model=None)
    async def kv_events() -> KVEventsInfo:
        """Where this engine publishes its KV cache events (--kv-events-config) and how: the
        PUB and replay endpoints as bound, topic, engine id and epoch of the topic frame,
        encoding, tokens per block; 404 when it publishes none. pdkv's route (vLLM has none):
        a router subscribes with it."""
        publisher = llm.engine.kv_event_publisher
        if publisher is None:
            raise APIError("this engine publishes no KV events (no --kv-events-config)", 404,
                           "NotFoundError")
        return publisher.info(llm.engine.config.scheduler_block_size)

    @app.post("/kv_events/held", response_model=None)
    async def kv_events_held(req: KVHeldRequest) -> dict[str, int]:
        """How many leading blocks of a prompt this engine's prefix cache holds right now
        (`{"held_blocks": k, "block_size": tokens}`): the ground truth a KV event index is
        checked against (the routing benchmark's oracle). Only while KV events are on (the
        hashes are published then anyway): 404 otherwise; 400 for a hash that is not 32 bytes of
        hex or more hashes than max_model_len has blocks. Reads the cache from the server
        thread, between engine steps or during one: a snapshot, not a lock."""
        engine = llm.engine
        if engine.kv_event_publisher is None:
            raise APIError("this engine publishes no KV events (no --kv-events-config)", 404,
                           "NotFoundError")
        block_size = engine.config.scheduler_block_size
        limit = engine.config.model_config.max_model_len // block_size + 1
        if len(req.block_hashes) > limit:
            raise APIError(f"at most {limit} block hashes (max_model_len / block size)",
                           param="block_hashes")
        try:
            hashes = [bytes.fromhex(h) for h in req.block_hashes]
        except ValueError:
            hashes = []
        if len(hashes) != len(req.block_hashes) or any(len(h) != 32 for h in hashes):
            raise APIError("block_hashes must be 32-byte hashes in hex", param="block_hashes")
        held = engine.scheduler.kv_cache_manager.num_cached_leading(hashes)
        return {"held_blocks": held, "block_size": block_size}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's route: forget the engine's prefix cache so the next identical prompt is
        computed again (or served by a KV pool). 200 (empty body) when reset; unlike vLLM,
        which answers 200 without checking, a refusal is an error: 409 while KV cache blocks
        are in use (running requests, KV transfers; nothing changed, retry when idle), 503
        when the engine is dead, 504 when the engine loop did not answer in time."""
        try:
            ok = await llm.reset_prefix_cache(RESET_PREFIX_CACHE_TIMEOUT_S)
        except EngineDeadError as e:
            raise APIError(str(e), 503, "ServiceUnavailableError") from None
        except TimeoutError:
            raise APIError(
                "the engine did not reset its prefix cache within "
                f"{RESET_PREFIX_CACHE_TIMEOUT_S:g} s",
                504,
                "GatewayTimeoutError",
            ) from None
        if not ok:
            raise APIError(
                "prefix cache not reset: KV cache blocks are in use (running requests or KV "
                "transfers); nothing was changed, retry when the engine is idle",
                409, "ConflictError",
            )
        return Response(status_code=200)

    @app.post("/tokenize", response_model=None)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        handlers.check_model(req.model)
        if req.messages is not None:
            try:
                msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            except ValueError as e:
                raise APIError(str(e)) from None
            special = bool(req.add_special_tokens)  # vLLM: False unless asked for
            ids = await handlers.tokenize(
                lambda tok: tok.encode_chat(msgs, req.add_generation_prompt, special)
            )
        elif req.prompt is not None:
            prompt = req.prompt
            special = req.add_special_tokens is not False  # vLLM: True unless turned off
            ids = await handlers.tokenize(lambda tok: tok.encode(prompt, special))
        else:
            raise APIError("give either prompt or messages")
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize", response_model=None)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        handlers.check_model(req.model)
        vocab = llm.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        tokens = req.tokens
        text = await handlers.tokenize(lambda tok: tok.decode(tokens, skip_special_tokens=False))
        return {"prompt": text}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        prepared = await handlers.prepare_completion(body, raw.headers.get("X-Request-Id"))
        return await _serve(prepared, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        prepared = await handlers.prepare_chat(body, raw.headers.get("X-Request-Id"))
        return await _serve(prepared, raw)

    async def _serve(p: PreparedRequest, raw: Request) -> Response:
        if not llm.is_running:
            raise APIError("engine is not running", 503, "ServiceUnavailableError")
        outputs = handlers.outputs(p)
        headers = {"X-Request-Id": p.request_id}
        if p.stream:
            return StreamingResponse(
                handlers.stream_response(p, outputs),
                media_type="text/event-stream",
                headers=headers,
            )
        body = await _until_done_or_disconnect(handlers.full_response(p, outputs), raw)
        return SafeJSONResponse(body, headers=headers)

    return app


async def _until_done_or_disconnect(
    coro: Awaitable[ChatCompletionResponse | CompletionResponse], raw: Request
) -> ChatCompletionResponse | CompletionResponse:
    """Await the response body; a client that disconnects first cancels it (which aborts the
    request in the engine).

    Raises:
        APIError: 499 (client gone), 400 (ValueError), 503 (engine dead).
    """
    try:
        result = await until_done_or_disconnect(coro, raw)
    except ClientDisconnected:
        raise APIError("client disconnected", 499, "ClientClosedRequest") from None
    except ValueError as e:
        raise APIError(str(e)) from None
    except EngineDeadError as e:
        raise APIError(str(e), 503, "ServiceUnavailableError") from None
    return result


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `pdkv serve`'s flags: MODEL (positional, or --model), the engine flags, the server's."""
    from pdkv.engine.arg_utils import EngineArgs

    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="alias (smollm2; tiny-llama-kv1, tiny-llama-kv2), HF id or model folder "
        "(same as --model, which it overrides)",
    )
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP server binds (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API")
    g.add_argument("--api-key", default=None)
    g.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    g.add_argument("--headless", action="store_true",
                   help="with --nnodes > 1 and --node-rank >= 1: run only this node's worker "
                   "ranks, connected to the leader at --master-addr (no engine, no HTTP server)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    g.add_argument("--log-stats-interval", type=float, default=DEFAULT_STATS_INTERVAL_S,
                   help="seconds between stats lines while busy")
    return parser


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens on it once the
    model is loaded), so a busy port fails before the model loads.

    Raises:
        OSError: the address cannot be bound (message names it and what to do).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; is another server using "
                      "it? choose another --port") from None
    sock.set_inheritable(True)
    return sock


def step_observer(metrics: ServerMetrics, args: argparse.Namespace) -> StepObserver:
    """The engine loop's step observer: Prometheus metrics, then (unless disabled) the stats
    line every --log-stats-interval s and one line per finished request."""
    observers: list[StepObserver] = [metrics.observe_step]
    if not getattr(args, "disable_log_stats", False):
        observers.append(
            StatsLogger(getattr(args, "log_stats_interval", DEFAULT_STATS_INTERVAL_S)).observe
        )
    if not getattr(args, "disable_log_requests", False):
        observers.append(RequestLogger().observe)

    def observe(outputs: list[RequestOutput], stats: SchedulerStats, now: float) -> None:
        for fn in observers:
            fn(outputs, stats, now)

    return observe


def inject_step_fault(engine: LLMEngine, at_step: int) -> None:
    """Test-only: make the model step of engine step number `at_step` (1-based) raise once
    (after scheduling, with the connector's metadata already bound), as a device fault would."""
    execute = engine.runner.execute_model

    def faulty(sched_out: SchedulerOutput) -> ModelRunnerOutput:
        if engine.num_steps + 1 == at_step:
            raise RuntimeError(f"injected fault at engine step {at_step} ({FAULT_STEP_ENV})")
        return execute(sched_out)

    # setattr: mypy forbids assigning to a method, which is the point of this seam.
    setattr(engine.runner, "execute_model", faulty)  # noqa: B010


def main(args: argparse.Namespace) -> int:
    """Build the engine and run the server until interrupted (0) or until the engine dies (1)."""
    import uvicorn

    from pdkv.engine.arg_utils import EngineArgs
    from pdkv.engine.llm_engine import LLMEngine

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine_args = EngineArgs.from_cli_args(args)
    if getattr(args, "headless", False):
        from pdkv.executor.headless import run_headless

        return run_headless(engine_args.create_engine_config().parallel_config)
    if engine_args.node_rank != 0:
        raise ValueError(f"--node-rank {engine_args.node_rank} runs worker ranks only: add "
                         "--headless (node 0 runs the engine)")
    sock = bind_socket(args.host, args.port)
    logger.info("engine args: %s", engine_args.summary())
    t0 = time.monotonic()
    try:
        engine = LLMEngine.from_engine_args(engine_args)
    except BaseException:
        sock.close()
        raise
    logger.info("model loaded in %.1f s: %s (%s) on %s", time.monotonic() - t0,
                engine.config.model_config.model, engine.config.model_config.path,
                engine.config.model_config.device)
    logger.info("resolved config: %s", engine.config)
    logger.info("KV cache: %s", engine.kv_cache_summary())
    fault_at = os.environ.get(FAULT_STEP_ENV)
    if fault_at:
        logger.warning(
            "%s=%s: the engine will fail on purpose (tests only)", FAULT_STEP_ENV, fault_at
        )
        inject_step_fault(engine, int(fault_at))
    name = engine.config.model_config.served_model_name
    metrics = ServerMetrics(name, max_model_len=engine.config.model_config.max_model_len)
    if engine.kv_event_publisher is not None:
        metrics.kv_events.watch(engine.kv_event_publisher.counters)
    llm = AsyncLLM(engine, step_observer(metrics, args))
    config = ServeConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=name,
        extra_model_names=tuple((args.served_model_name or [])[1:]),
    )
    app = build_app(llm, config, metrics)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=10,
            timeout_keep_alive=int(SERVER_KEEPALIVE_S),
        )
    )

    def on_engine_dead(error: BaseException) -> None:
        server.should_exit = True  # uvicorn polls this flag: stop serving, then main returns 1

    llm.add_dead_callback(on_engine_dead)
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a second Ctrl-C during the graceful shutdown
        return 130
    if llm.errored is not None:
        logger.error("exiting: the engine died (%s: %s)", type(llm.errored).__name__, llm.errored)
        return 1
    return 0
