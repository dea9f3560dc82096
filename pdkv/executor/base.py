"""What the engine needs of whatever runs the model: the `Executor` protocol.

Two executors implement it: `pdkv.executor.inproc.InProcExecutor` (one ModelRunner in the engine
process) and `pdkv.executor.multiproc.MultiprocExecutor` (one worker process per TP/DCP rank).
Either sizes the engine's KV cache once (`pdkv.worker.kv_cache.make_kv_cache_config`); the model
runners it drives receive the result and never size the cache themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from pdkv.cache.kv_layout import KVLayout
    from pdkv.cache.specs import KVCacheConfig
    from pdkv.kv_transfer.connector.startup import ConnectorStartup
    from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput
    from pdkv.worker.model_runner import ModelRunner


class Executor(Protocol):
    """Runs the model for one engine: what `LLMEngine` uses, and nothing else.

    Attributes:
        kv_cache_config: the scheduler's view of the KV cache: `num_blocks` logical blocks of
            block_size × DCP tokens per group (with DCP each rank stores 1/dcp of a block).
        kv_layout: the KV layout the scheduler half of a KV connector is built with (P/D
            identity checks; its wire form answers `GET /kv_layout`).
        connector_startup: start-up values both halves of the engine's KV connector share
            (what the worker halves bound: the P2P producer's control addresses).
        vocab_size, eos_token_id: the model's.
        model_runner: the ModelRunner when the model runs in this process (inspection by tests
            and benchmarks), else None.
    """

    @property
    def kv_cache_config(self) -> KVCacheConfig: ...

    @property
    def kv_layout(self) -> KVLayout: ...

    @property
    def connector_startup(self) -> ConnectorStartup: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def model_runner(self) -> ModelRunner | None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; the tokens sampled for requests that reached their end.

        Raises:
            WorkerDiedError / TimeoutError (worker processes): a rank failed, exited or did not
                answer in time; the engine cannot continue.
        """
        ...

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """Called once by the engine at start-up (the engine loop's thread) with the callback
        that wakes the engine loop; `wakeup` must never block. The KV connector's worker halves
        call it (in process: directly, from their threads; in worker processes: through the
        executor's wakeup channel and its listener thread) when the next step would see
        something new: a load or send finished, a load failed. Worker processes: the listener
        also calls it once when a worker exits, so that the next step reports the dead rank."""
        ...

    def next_deadline(self) -> float | None:
        """Engine loop thread, non-blocking: the earliest time.monotonic() at which the KV
        connector's worker halves need a step even if nothing else happens (a lease expiry or
        renewal, a pull's deadline), or None."""
        ...

    def dead_workers(self) -> list[int]:
        """Ranks whose worker process has exited ([] in process); any thread may ask."""
        ...

    def shutdown(self) -> None:
        """Release the model, the KV connector's worker half and any worker processes."""
        ...
