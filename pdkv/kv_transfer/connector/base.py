"""KV connector API (vLLM v1's KVConnectorBase_V1 lifecycle).

One connector class is instantiated twice: with role SCHEDULER inside the scheduler and with role
WORKER inside the model runner. The two halves talk only through typed metadata: the scheduler
half builds a `KVConnectorMetadata` each step (carried in `SchedulerOutput.kv_connector_metadata`),
the worker half reports a `KVConnectorOutput` (carried in `ModelRunnerOutput`).

Scheduler-half call order per request (all in the engine loop thread, none may block):
`get_num_new_matched_tokens` (waiting request, after the local prefix-cache lookup) →
`update_state_after_alloc` (after blocks are allocated) → `build_connector_meta` (end of every
schedule) → ... `update_connector_output` (after every step) → `request_finished` (once, before
the request's blocks are freed).

Worker-half call order per step (engine loop thread; transfers run on the connector's own
threads): `bind_connector_metadata` → `start_load_kv` → forward (`wait_for_layer_load` /
`save_kv_layer` per layer) → `wait_for_save` → `get_finished` → `get_block_ids_with_load_errors`
→ `clear_connector_metadata`. Steps that schedule no tokens still run this sequence so
transfers keep progressing.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgspec

# The typed scheduler <-> worker messages live with the scheduler's outputs (pdkv.sched); they are
# re-exported here for the connectors.
from pdkv.jsontypes import JSONObject
from pdkv.sched.output import KVConnectorMetadata as KVConnectorMetadata
from pdkv.sched.output import KVConnectorOutput as KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from pdkv.cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from pdkv.cache.kv_layout import KVLayout
    from pdkv.cache.specs import KVCacheConfig
    from pdkv.kv_transfer.connector.spec import ConnectorSpec
    from pdkv.kvpool.events import PoolEventQueue
    from pdkv.request import Request
    from pdkv.sched.output import SchedulerOutput


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorBase(ABC):
    """Base class of every connector.

    Args:
        spec: the connector's spec (name, role, engine id, its settings; `connector_spec`).
        role: which half this instance is.
        kv_cache_config: KV cache groups and block sizes of this engine.
        layout: this engine's KV layout (model digest, dtype, block size, layers, KV heads,
            head size, layout name, parallelism), compared with the peer's.
    """

    def __init__(
        self,
        spec: ConnectorSpec,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        layout: KVLayout,
    ) -> None:
        self.spec = spec
        self.role = role
        self.kv_cache_config = kv_cache_config
        self.layout = layout
        self._metadata: KVConnectorMetadata | None = None

    # ================================================================ scheduler
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Scheduler half, once at start-up (vLLM's `bind_gpu_block_pool`): the scheduler's
        block manager, e.g. to install an eviction hook (CPU offload). Default: unused."""

    def validate_request(self, request: Request) -> None:
        """Called when a request is created, before it is queued (caller's thread).

        Raises:
            ValueError: its kv_transfer_params cannot be honoured (message names both values).
        """

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` (local hits) that can be loaded from outside,
        and whether the load is asynchronous. None = ask again next step. Side-effect free.

        Asynchronous (True): the request gets blocks for them and waits in
        WAITING_FOR_REMOTE_KVS until the worker half reports it in `finished_recving`; then the
        last prompt token is recomputed. Synchronous (False): the worker half loads them in
        `start_load_kv` / `wait_for_layer_load` of the step that schedules the request; the
        scheduler counts them as computed (and cached) and schedules only the tokens after
        them. The scheduler caps a synchronous count so that the last token is computed:
        `update_state_after_alloc` receives the count actually used."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for the request; `blocks` are its new (unfilled) blocks.

        Called once per admission, with `request.num_computed_tokens` = its local prefix hits:
        the `num_external_tokens` to load start right after them (0 = load nothing)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata for the worker; resets the per-step state."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Worker results of the last step (after the scheduler has used them)."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, JSONObject | None]:
        """Called once when a request finishes, before its blocks are freed.

        Returns:
            (delay_free, kv_transfer_params): with delay_free the scheduler keeps the blocks
            until the id shows up in finished_sending (or finished_recving for a request whose
            load is still in flight); the params are returned to the client.
        """

    def take_scheduler_stats(self) -> dict[str, float]:
        """Scheduler half: counter deltas of its own since the last call (e.g. pool lookup and
        hit tokens), added to the engine's cumulative KV counters."""
        return {}

    def has_pending_work(self) -> bool:
        """True while this connector still has something unfinished (sends to register, leases
        to watch, loads in flight). The engine does not step for this alone: it steps on
        `has_pending_metadata`, on a `wakeup()` from the worker half and at `next_deadline`."""
        return False

    def has_pending_metadata(self) -> bool:
        """Scheduler half (engine loop thread, non-blocking): True when the next
        `build_connector_meta` would carry something for the worker (sends to register, loads to
        start, notices to deliver), so the engine must step soon even with no tokens to run."""
        return False

    def next_deadline(self) -> float | None:
        """Either half (engine loop thread, non-blocking): the earliest `time.monotonic()` at
        which the engine must step for this connector even if nothing else happens (a lease
        expiry, a lease renewal), or None when there is none."""
        return None

    # =================================================================== worker
    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """Either half; called once by the engine at start-up (engine loop thread). The
        connector must call `wakeup()` (from any of its threads; it never blocks) whenever the
        next step would see something new: a load or send finished, a load failed, a notice
        arrived, a remote lookup answered. The engine loop sleeps until a wakeup, a request, or
        `next_deadline`."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Once, after allocation: the per-group KV cache tensors
        [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]."""

    @classmethod
    def metadata_type(cls) -> type[KVConnectorMetadata]:
        """The class of this connector's per-step metadata (a worker in another process rebuilds
        it from msgpack with it)."""
        return KVConnectorMetadata

    def metadata_from_wire(self, raw: object) -> KVConnectorMetadata:
        """This connector's per-step metadata rebuilt from its msgpack form (a worker process
        receives it untyped); `metadata_type` names the class.

        Raises:
            msgspec.ValidationError: `raw` does not fit the type.
        """
        return msgspec.convert(raw, self.metadata_type())

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        """Before the forward pass: start (asynchronous) loads and other transfers."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Inside the forward pass (the model's layer loop, engine loop thread; `LayerHooks` in
        pdkv/model/layer_hooks.py), before model layer `layer_index` reads its KV: may block
        until that layer's KV is loaded (layer-wise loads). Not called on steps that run no
        forward, nor inside a CUDA graph (graphs are off while a connector is set)."""

    def save_kv_layer(self, layer_index: int) -> None:
        """Inside the forward pass (as `wait_for_layer_load`), after model layer `layer_index`
        wrote this step's K/V: start saving / sending it (layer-wise saves, e.g. the P2P push
        mode's sender); must not block on the network."""

    def wait_for_save(self) -> None:
        """After the forward pass (engine loop thread): block, up to the connector's deadline,
        until saves that read the paged buffer are done (the step's blocks may be reused after
        it)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        """(group index, local block id) of blocks whose load failed since the last call."""
        return set()

    def get_stats(self) -> tuple[dict[str, float], list[float]]:
        """Counter deltas and transfer durations (s) since the last call."""
        return {}, []

    def get_observations(self) -> dict[str, list[float]]:
        """Histogram samples by metric key since the last call (worker half)."""
        return {}

    def get_request_bytes(self) -> dict[str, dict[str, float]]:
        """Worker half: request id -> {path: bytes loaded} since the last call."""
        return {}

    def get_load_failure_policies(self) -> dict[str, str]:
        """Request id -> policy for loads that failed since the last `get_load_errors` (worker
        half, called right after it); {} = the engine's policy for all."""
        return {}

    def get_load_errors(self) -> dict[str, str]:
        """Request id -> failure message of loads that failed since the last call."""
        return {}

    def kv_cache_buffer(self, group: int, nbytes: int) -> memoryview | None:
        """Memory to build group `group`'s KV cache on (e.g. shared memory), or None."""
        return None

    def on_new_request(self, request: Request) -> None:
        """Scheduler half: a request was queued."""

    def report_tier_events(self, queue: PoolEventQueue) -> None:
        """Scheduler half, once at start-up (engine loop thread), only when the engine publishes
        KV events and runs its worker half in this process: put the KV events of the KV pool
        tiers this connector writes (chunks stored and dropped, `pdkv.kvpool.events`) into
        `queue`. Connectors without a pool ignore it."""

    def shutdown(self) -> None:
        """Stop threads and close sockets."""


class SchedulerHalf(Protocol):
    """The scheduler-half object a RoleDelegatingConnector forwards to (same methods as the
    connector's; optionally also `take_scheduler_stats` and `has_pending_work`)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata: ...

    def update_connector_output(self, output: KVConnectorOutput) -> None: ...

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, JSONObject | None]: ...

    def has_pending_metadata(self) -> bool: ...


class RoleDelegatingConnector(KVConnectorBase):
    """A connector built from two objects, one per half: `self.scheduler` (role SCHEDULER) and
    `self.worker` (role WORKER, typed by the subclass); exactly one is set. The scheduler-half
    calls every such connector has are forwarded here (the halves implement the same method
    names); subclasses forward their worker-half calls, whose metadata types differ."""

    scheduler: SchedulerHalf | None = None

    def _sched(self) -> SchedulerHalf:
        assert self.scheduler is not None, "a scheduler-half call on the worker half"
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(output)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, JSONObject | None]:
        return self._sched().request_finished(request, block_ids)

    def take_scheduler_stats(self) -> dict[str, float]:
        take = getattr(self.scheduler, "take_scheduler_stats", None)
        stats: dict[str, float] = take() if take is not None else {}
        return stats

    def has_pending_metadata(self) -> bool:
        return bool(self.scheduler is not None and self.scheduler.has_pending_metadata())

    def has_pending_work(self) -> bool:
        check = getattr(self.scheduler, "has_pending_work", None)
        return bool(check()) if check is not None else False
