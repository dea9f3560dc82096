"""AsyncLLM: an LLMEngine stepped by a background thread, consumed from asyncio.

The engine loop thread owns the engine: it drains a command queue (add / abort / wake / calls
such as reset_prefix_cache), runs `engine.step()` while a step has work now
(`engine.needs_step()`), and otherwise sleeps on the queue until a command, a connector wakeup
(a transfer finished) or the connector's next deadline (lease expiry / renewal). Each
RequestOutput goes to the asyncio loop of the request's consumer (`loop.call_soon_threadsafe`).
Validation happens in the caller (`make_request`), so bad input fails before anything is queued.
A step that raises kills the engine (EngineDeadError), as in vLLM: its state can no longer be
trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from pdkv.engine.llm_engine import LLMEngine, PromptType
from pdkv.jsontypes import JSONObject
from pdkv.outputs import RequestOutput
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams
from pdkv.sched.output import SchedulerStats

logger = logging.getLogger(__name__)


# The loop steps this long after a connector deadline, so that the deadline has passed.
_DEADLINE_SLACK_S = 0.001
# Requests waiting for blocks that nobody will free before an event (blocks held for remote
# reads): after two steps in a row that ran nothing and output nothing, the loop backs off from
# this pause, doubling up to the cap; any command or wakeup ends the pause at once.
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.001, 0.1


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or it was shut down); no request can be served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


StepObserver = Callable[[list[RequestOutput], SchedulerStats, float], None]


T = TypeVar("T")


@dataclass(frozen=True)
class _Add:
    """Queue a request (made by make_request) in the engine."""

    request: Request
    prompt_text: str | None


@dataclass(frozen=True)
class _Abort:
    """Abort a request at any stage."""

    request_id: str


@dataclass(frozen=True)
class _Call:
    """Run `run(engine)` on the loop thread (it reports its own result or exception)."""

    run: Callable[[LLMEngine], None]


_Command = _Add | _Abort | _Call | None
"""What the loop thread's queue carries; None only wakes the loop."""


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
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._engine_shut = False
        self._empty_steps = 0  # steps in a row that ran no tokens and output nothing
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        self.errored: BaseException | None = None

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine loop thread."""
        self._thread = threading.Thread(target=self._run, name="pdkv-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop (waits up to `timeout` s for it) and shut the engine down."""
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        self._shutdown_engine()

    def _shutdown_engine(self) -> None:
        with self._lock:
            if self._engine_shut:
                return
            self._engine_shut = True
        self.engine.shutdown()

    def add_dead_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` (from the loop thread) when a failure kills the engine."""
        with self._lock:
            self._dead_callbacks.append(callback)

    @property
    def is_running(self) -> bool:
        """The loop thread is alive and the engine has not died."""
        return self._thread is not None and self._thread.is_alive() and self.errored is None

    # ----------------------------------------------------------------- requests
    def make_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer_params: JSONObject | None = None,
        cache_salt: str | None = None,
    ) -> tuple[Request, str | None]:
        """Validate and tokenize (caller's thread). Raises ValueError on bad input."""
        return self.engine.make_request(
            prompt, params, request_id, cache_salt=cache_salt, kv_transfer_params=kv_transfer_params
        )

    async def generate(
        self, request: Request, prompt_text: str | None
    ) -> AsyncIterator[RequestOutput]:
        """Queue the request and yield its outputs step by step until it finishes.

        Leaving the iterator early (client disconnect, cancellation) aborts the request.

        Raises:
            ValueError: the request id is already in flight.
            EngineDeadError: the engine is not running or died while running the request.
        """
        rid = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:  # _die marks errored under this lock: no stream is left unanswered
            if not self.is_running:
                raise EngineDeadError("engine is not running")
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream
        self._commands.put(_Add(request, prompt_text))
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
        self._commands.put(_Abort(request_id))

    async def reset_prefix_cache(self, timeout_s: float = 10.0) -> bool:
        """Reset the engine's prefix cache on the loop thread (LLMEngine.reset_prefix_cache).

        Returns:
            True when reset; False when KV cache blocks were in use (nothing changed).

        Raises:
            EngineDeadError: the engine is not running.
            TimeoutError: the loop did not run the command within `timeout_s` seconds (it may
                still run it later).
        """
        return bool(await self._call_async(lambda engine: engine.reset_prefix_cache(), timeout_s))

    async def call_async(self, fn: Callable[[LLMEngine], T], timeout_s: float) -> T:
        """Run fn(engine) as a command on the loop thread, between steps; await its result for
        at most `timeout_s` seconds (TimeoutError; fn may still run later). fn's exception is
        raised here; EngineDeadError when the engine is not running."""
        return await self._call_async(fn, timeout_s)

    async def _call_async(self, fn: Callable[[LLMEngine], T], timeout_s: float) -> T:
        """Run fn(engine) as a command on the loop thread; await its result for at most
        `timeout_s` seconds (TimeoutError). fn's exception is raised here."""
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(outcome: tuple[T] | Exception) -> None:  # runs on `loop`
            if future.done():  # the caller gave up (timeout, cancellation)
                return
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome[0])

        def run(engine: LLMEngine) -> None:  # runs on the engine loop thread
            outcome: tuple[T] | Exception
            try:
                outcome = (fn(engine),)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                outcome = e
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                loop.call_soon_threadsafe(settle, outcome)

        self._commands.put(_Call(run))
        return await asyncio.wait_for(future, timeout_s)

    def call(self, fn: Callable[[LLMEngine], T], timeout: float = 10.0) -> T:
        """Run fn(engine) in the loop thread and return its result (for stats in tests)."""
        done: queue.Queue[tuple[T] | Exception] = queue.Queue()

        def run(engine: LLMEngine) -> None:
            try:
                done.put((fn(engine),))
            except Exception as e:  # noqa: BLE001
                done.put(e)

        self._commands.put(_Call(run))
        outcome = done.get(timeout=timeout)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome[0]

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        """Event-driven: step while a step has work now; otherwise sleep on the command queue
        until a command, a connector wakeup or the connector's next deadline, then step once
        (an empty step still runs the connector sequence and collects its results)."""
        engine = self.engine
        try:
            engine.set_wakeup(self._wake)
            while not self._stop.is_set():
                if engine.needs_step():
                    self._drain(timeout=self._backoff_timeout())
                else:
                    self._drain(timeout=self._idle_timeout())
                    # Woken idle (a rank's wakeup channel ended, among others): a lost rank
                    # ends the engine now, not at the next request.
                    engine.check_workers()
                if self._stop.is_set():
                    break
                self._step()
        except BaseException as e:  # noqa: BLE001 - any failure ends the engine (EngineDeadError)
            self._die(e)
            return
        with self._lock:
            rids = list(self._streams)
        for rid in rids:  # shut down with requests in flight: end their streams too
            self._deliver(rid, EngineDeadError("engine shut down"))

    def _idle_timeout(self) -> float | None:
        """Seconds to sleep with nothing to step: until the next connector deadline (plus a
        millisecond, so the deadline has passed when the step runs), or None (no deadline)."""
        deadline = self.engine.next_deadline()
        if deadline is None:
            return None
        return max(0.0, deadline - time.monotonic()) + _DEADLINE_SLACK_S

    def _backoff_timeout(self) -> float:
        """0 while steps make progress; a growing pause (capped by the next deadline) while
        requests wait for blocks that only an event can free."""
        if self._empty_steps < 2:  # the first empty step may just have moved requests on
            return 0.0
        pause = min(_BACKOFF_MAX_S, _BACKOFF_MIN_S * 2.0 ** min(self._empty_steps - 2, 16))
        idle = self._idle_timeout()
        return pause if idle is None else min(pause, idle)

    def _step(self) -> None:
        engine = self.engine
        outputs = engine.step()
        empty = not outputs and engine.last_num_scheduled_tokens == 0
        self._empty_steps = self._empty_steps + 1 if empty else 0
        now = time.monotonic()
        for out in outputs:
            self._deliver(out.request_id, out)
        if self.step_observer is not None:
            self.step_observer(outputs, engine.scheduler.stats(), now)

    def _wake(self) -> None:
        # Connector threads call this; Queue.put on an unbounded queue never blocks.
        self._commands.put(None)

    def _drain(self, timeout: float | None) -> None:
        """Handle every queued command; wait up to `timeout` s for the first (None: forever,
        0: do not wait). A command or wakeup may unblock waiting requests: no pause after it."""
        try:
            if timeout == 0.0:
                cmd = self._commands.get_nowait()
            else:
                cmd = self._commands.get(timeout=timeout)
        except queue.Empty:
            return
        self._empty_steps = 0
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: _Command) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            request = cmd.request
            with self._lock:
                alive = request.request_id in self._streams
            try:
                engine.add_request(request, cmd.prompt_text)
            except ValueError as e:
                self._deliver(request.request_id, e)
                return
            if not alive:
                # The client left before the request reached the loop. The scheduler still
                # sees it, aborted at once, so that its connectors let go of what it holds
                # elsewhere: a P/D consumer tells P to release the grant its
                # kv_transfer_params name, instead of P holding the blocks for a lease.
                self._handle(_Abort(request.request_id))
        elif isinstance(cmd, _Abort):
            outs = engine.abort_request([cmd.request_id])
            for out in outs:
                self._deliver(out.request_id, out)
            if self.step_observer is not None:
                self.step_observer(outs, engine.scheduler.stats(), time.monotonic())
        elif isinstance(cmd, _Call):
            cmd.run(engine)

    def _die(self, error: BaseException) -> None:
        """The engine failed: its state (scheduler, held blocks, connector reports of the
        failed step) can no longer be trusted, so it serves nothing more. Every in-flight
        request and every later one gets EngineDeadError; the dead callbacks run (the server
        exits); the engine is shut down so remote peers see its transfer endpoints close."""
        logger.error("engine step failed; the engine is dead", exc_info=error)
        with self._lock:
            self.errored = error
            rids = list(self._streams)
            callbacks = list(self._dead_callbacks)
        for rid in rids:
            self._deliver(rid, EngineDeadError(f"engine died: {type(error).__name__}: {error}"))
        try:
            self._shutdown_engine()
        except Exception:  # noqa: BLE001 - best effort on an engine that already failed
            logger.exception("engine shutdown after failure failed")
        for cb in callbacks:
            cb(error)

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(rid)
        if stream is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed consumer loop: nobody is listening
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
