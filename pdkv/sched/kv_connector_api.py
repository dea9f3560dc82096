"""What the scheduler knows of a KV connector (torch-free): `SchedulerConnector`, the calls the
scheduler makes on a connector's scheduler half (vLLM's KVConnectorBase_V1 scheduler-side
methods). pdkv.kv_transfer.connector.base's `KVConnectorBase` implements it; the typed messages
between the halves (KVConnectorMetadata, KVConnectorOutput) live with the scheduler's outputs in
pdkv.sched.output. The scheduler imports only these, so it sits below the connectors (they
import its outputs) and no import runs in a cycle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdkv.cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from pdkv.request import Request
    from pdkv.sched.output import KVConnectorMetadata, KVConnectorOutput, SchedulerOutput


class SchedulerConnector(Protocol):
    """The scheduler half's calls, as the scheduler makes them (semantics and errors:
    pdkv.kv_transfer.connector.base.KVConnectorBase, which implements this)."""

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None: ...

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata: ...

    def update_connector_output(self, output: KVConnectorOutput) -> None: ...

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]: ...

    def on_new_request(self, request: Request) -> None: ...

    def take_scheduler_stats(self) -> dict[str, float]: ...

    def has_pending_work(self) -> bool: ...

    def has_pending_metadata(self) -> bool: ...
