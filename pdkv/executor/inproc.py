"""InProcExecutor: the model runs in the engine process, on one ModelRunner."""

from __future__ import annotations

from collections.abc import Callable

from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import KVCacheConfig
from pdkv.config import EngineConfig
from pdkv.kv_transfer.connector.base import KVConnectorBase
from pdkv.kv_transfer.connector.spec import ConnectorSpec
from pdkv.kv_transfer.connector.startup import ConnectorStartup
from pdkv.model.arch_config import LlamaArchConfig
from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput
from pdkv.worker.kv_cache import KVCacheSizing, make_kv_cache_config
from pdkv.worker.model_runner import ModelRunner


class InProcExecutor:
    """One ModelRunner in this process (world size 1): the `Executor` of a single-rank engine.

    The runner loads the weights, then this executor sizes its KV cache (`make_kv_cache_config`,
    once), and the runner allocates it and builds the worker half of the KV connector, if any.

    Args:
        config: the engine's configuration.
        sizing: what sizing the KV cache takes (read from `config` by the engine).
        connector: the KV connector's spec (`connector_spec` of config.kv_transfer_config),
            None without one; the runner builds its worker half.

    Raises:
        ValueError: max_model_len exceeds the model's positions, or the KV cache cannot hold one
            request of max_model_len tokens (named values).
    """

    def __init__(self, config: EngineConfig, sizing: KVCacheSizing,
                 connector: ConnectorSpec | None) -> None:
        self._sizing = sizing
        self.runner = ModelRunner(config.model_config, config.cache_config, connector, None,
                                  self._size)
        self.kv_cache_config: KVCacheConfig = self.runner.kv_cache_config
        self.kv_layout: KVLayout = self.runner.kv_layout
        self.connector_startup: ConnectorStartup = self.runner.connector_startup
        self.connector: KVConnectorBase | None = self.runner.connector
        self.vocab_size = self.runner.vocab_size
        self.eos_token_id: int | None = self.runner.eos_token_id

    def _size(self, arch: LlamaArchConfig, budget_bytes: int | None) -> KVCacheConfig:
        return make_kv_cache_config(arch, self._sizing, budget_bytes)

    @property
    def model_runner(self) -> ModelRunner:
        """The runner (inspection: tests, benchmarks)."""
        return self.runner

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the runner."""
        return self.runner.execute_model(scheduler_output)

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """Hand the engine loop's wakeup to the connector's worker half (it calls it itself)."""
        if self.connector is not None:
            self.connector.set_wakeup(wakeup)

    def next_deadline(self) -> float | None:
        """The connector worker half's next deadline, or None."""
        return self.connector.next_deadline() if self.connector is not None else None

    def dead_workers(self) -> list[int]:
        """No worker processes: always []."""
        return []

    def shutdown(self) -> None:
        """Shut the runner's connector half down (the model is freed with the executor)."""
        self.runner.shutdown()
