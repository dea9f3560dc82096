"""AsyncLLM: an LLMEngine stepped by a background thread, consumed from asyncio.

The engine loop thread owns the engine: it drains a command queue (add / abort), runs
`engine.step()` while requests are unfinished, and hands each RequestOutput to the asyncio loop
of the request's consumer (`loop.call_soon_threadsafe`). Validation and tokenization happen in the
caller (`make_request`), so bad input fails before anything is queued.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pdkv.engine.llm_engine import LLMEngine, PromptType
from pdkv.outputs import RequestOutput
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams
from pdkv.sched.output import SchedulerStats

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (internal error)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


StepObserver = Callable[[list[RequestOutput], SchedulerStats, float], None]


class AsyncLLM:
    """Thread-backed async front of one LLMEngine.

    Args:
        engine: the engine (used only from the loop thread after start()).
        step_observer: optional callback(outputs, scheduler stats, step end time) called in the
            loop thread after every step (metrics); it must not block.
    """

    def __init__(self, engine: LLMEngine, step_observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.step_observer = step_observer
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.errored: BaseException | None = None

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pdkv-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.errored is None

    # ----------------------------------------------------------------- requests
    def make_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> tuple[Request, str | None]:
        """Validate and tokenize (caller's thread). Raises ValueError on bad input."""
        return self.engine.make_request(
            prompt, params, request_id, cache_salt=cache_salt, kv_transfer_params=kv_transfer_params
        )

    async def generate(self, request: Request, prompt_text: str | None) -> AsyncIterator[RequestOutput]:
        """Queue the request and yield its outputs step by step until it finishes.

        Leaving the iterator early (client disconnect, cancellation) aborts the request.

        Raises:
            ValueError: the request id is already in flight.
            EngineDeadError: the engine loop is not running.
            RequestFailedError: the engine failed while running the request.
        """
        if not self.is_running:
            raise EngineDeadError("engine loop is not running")
        rid = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream
        self._commands.put(("add", (request, prompt_text)))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request at any stage (thread-safe, asynchronous)."""
        self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], Any], timeout: float = 10.0) -> Any:
        """Run fn(engine) in the loop thread and return its result (for stats in tests)."""
        done: queue.Queue[Any] = queue.Queue()
        self._commands.put(("call", (fn, done)))
        ok, value = done.get(timeout=timeout)
        if not ok:
            raise value
        return value

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain(block=not engine.has_work())
                if not engine.has_work():
                    continue
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - fail the in-flight requests, keep serving
                    logger.exception("engine step failed")
                    self._fail_all(e)
                    continue
                now = time.monotonic()
                for out in outputs:
                    self._deliver(out.request_id, out)
                if self.step_observer is not None:
                    self.step_observer(outputs, engine.scheduler.stats(), now)
                if engine.last_num_scheduled_tokens == 0 and not outputs:
                    time.sleep(0.001)  # only transfers in flight: do not spin
        except BaseException as e:  # pragma: no cover - defensive
            self.errored = e
            logger.exception("engine loop died")
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, EngineDeadError(str(e)))

    def _drain(self, block: bool) -> None:
        try:
            cmd, arg = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd, arg)
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: str, arg: Any) -> None:
        engine = self.engine
        if cmd == "add":
            request, text = arg
            with self._lock:
                alive = request.request_id in self._streams
            if not alive:  # the client left before the request reached the loop
                return
            try:
                engine.add_request(request, text)
            except ValueError as e:
                self._deliver(request.request_id, e)
        elif cmd == "abort":
            outs = engine.abort_request([arg])
            for out in outs:
                self._deliver(out.request_id, out)
            if self.step_observer is not None:
                self.step_observer(outs, engine.scheduler.stats(), time.monotonic())
        elif cmd == "call":
            fn, done = arg
            try:
                done.put((True, fn(engine)))
            except Exception as e:  # noqa: BLE001
                done.put((False, e))

    def _fail_all(self, error: Exception) -> None:
        engine = self.engine
        unfinished = list(engine.scheduler.requests)
        engine.abort_request(unfinished)
        for rid in unfinished:
            self._deliver(rid, RequestFailedError(f"internal engine error: {error}"))

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(rid)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
