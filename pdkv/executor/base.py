"""What the engine needs of whatever runs the model: the `Executor` protocol.

Two executors implement it: `pdkv.executor.inproc.InProcExecutor` (one ModelRunner in the engine
process) and `pdkv.executor.multiproc.MultiprocExecutor` (one worker process per TP/DCP rank).
Either sizes the engine's KV cache once (`pdkv.worker.kv_cache.make_kv_cache_config`); the model
runners it drives receive the result and never size the cache themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdkv.cache.kv_layout import KVLayout
    from pdkv.cache.specs import KVCacheConfig
    from pdkv.kv_transfer.connector.base import KVConnectorBase
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
        connector: the worker half of the KV connector when it lives in this process, else None
            (none configured, or it lives in worker processes).
        poll_interval_s: seconds between engine steps while worker connector halves have loads
            in flight, when those halves cannot wake the engine loop (other processes); None when
            they can.
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
    def connector(self) -> KVConnectorBase | None: ...

    @property
    def poll_interval_s(self) -> float | None: ...

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

    def dead_workers(self) -> list[int]:
        """Ranks whose worker process has exited ([] in process); any thread may ask."""
        ...

    def shutdown(self) -> None:
        """Release the model, the KV connector's worker half and any worker processes."""
        ...
