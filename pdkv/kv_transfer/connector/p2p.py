"""P2PConnector: prefill engine → decode engine KV hand-off (pull) over a transfer engine.

`--kv-transfer-config '{"kv_connector": "P2PConnector", "kv_role": "kv_producer",
"kv_connector_extra_config": {"transfer": "tcp"}}'`. Extra config: transfer (tcp | shm |
mooncake), kv_host / kv_port (producer control server bind address, default 127.0.0.1 / any free
port), kv_advertise_host (the host put into kv_transfer_params; default kv_host, never a wildcard),
transfer_port (tcp data port), kv_lease_duration (s, default 30), transfer_timeout (s per pull,
from submit, default 30), kv_pulls_per_peer (2), kv_pull_threads (16), kv_server_max_connections
(64), kv_server_idle_timeout (s, 60), transfer_mode (pull | push; push: p2p_push.py). See
p2p_messages.py for grants (request id, nonce, prompt
digest) and docs/PD.md ("P/D disaggregation", Threat model) for the threat model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdkv.jsontypes import JSONObject
from pdkv.kv_transfer.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from pdkv.kv_transfer.connector.p2p_messages import P2PConnectorMetadata, PushGrant
from pdkv.kv_transfer.connector.p2p_push import layer_slots
from pdkv.kv_transfer.connector.p2p_scheduler import P2PConnectorScheduler
from pdkv.kv_transfer.connector.p2p_worker import P2PConnectorWorker
from pdkv.kv_transfer.connector.startup import Address

if TYPE_CHECKING:
    import torch

    from pdkv.cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from pdkv.cache.kv_layout import KVLayout
    from pdkv.cache.specs import KVCacheConfig
    from pdkv.kv_transfer.connector.spec import P2PSpec
    from pdkv.request import Request
    from pdkv.sched.output import SchedulerOutput


class P2PConnector(KVConnectorBase):
    """Delegates to P2PConnectorScheduler or P2PConnectorWorker by role.

    `control_address` is the producer's [host, port]; the worker half fills it when its control
    server starts, the scheduler half puts it into kv_transfer_params. Both halves of one engine
    are built with the same list (a start-up value, like vLLM's side-channel host/port).
    `dcp_rank` / `dcp_size`: the worker half's DCP rank and size (P/D into DCP; 0 / 1 otherwise);
    `rank` / `world_size`: its global rank and the engine's worker count (default: the DCP ones).
    `control_endpoints`: every worker rank's [host, port] (a multi-process producer; the scheduler
    half lists them in kv_transfer_params "endpoints").
    `push_address`: push mode, consumer: its data server's [host, port], filled by the worker
    half, put into grants by the scheduler half (like `control_address`).
    """

    def __init__(
        self,
        spec: P2PSpec,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        layout: KVLayout,
        control_address: Address | None = None,
        dcp_rank: int = 0,
        dcp_size: int = 1,
        rank: int | None = None,
        world_size: int | None = None,
        control_endpoints: list[Address] | None = None,
        push_address: Address | None = None,
    ) -> None:
        super().__init__(spec, role, kv_cache_config, layout)
        address: Address = control_address if control_address is not None else ["127.0.0.1", 0]
        block_size = kv_cache_config.groups[0].spec.block_size
        push: Address = push_address if push_address is not None else ["127.0.0.1", 0]
        self.scheduler = (
            P2PConnectorScheduler(spec, layout, block_size, address, len(kv_cache_config.groups),
                                  kv_cache_config.sliding_windows, control_endpoints,
                                  tuple(g.spec.state_slot
                                        for g in kv_cache_config.groups), push)
            if role == KVConnectorRole.SCHEDULER
            else None
        )
        self.worker = (P2PConnectorWorker(spec, layout, address, dcp_rank, dcp_size, rank,
                                          world_size, layer_slots(kv_cache_config), push)
                       if role == KVConnectorRole.WORKER else None)

    @classmethod
    def metadata_type(cls) -> type[KVConnectorMetadata]:
        return P2PConnectorMetadata

    # scheduler half
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        assert self.scheduler is not None
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def push_grant(self, request_id: str) -> PushGrant | None:
        """Push mode, consumer's scheduler half (engine loop thread): the write window opened
        for request `request_id` once it was admitted (its blocks allocated), else None."""
        assert self.scheduler is not None
        return self.scheduler.push_grant(request_id)

    def push_first_token(self, request_id: str, token: int) -> None:
        """Push mode, consumer's scheduler half (engine loop thread), a linear-state model: P's
        sampled token for request `request_id`.

        Raises:
            ValueError: no open window of that request waits for a token.
        """
        assert self.scheduler is not None
        self.scheduler.push_first_token(request_id, token)

    def validate_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.validate_request(request)

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, JSONObject | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_work(self) -> bool:
        return self.scheduler.has_pending_work() if self.scheduler is not None else False

    def has_pending_metadata(self) -> bool:
        return self.scheduler.has_pending_metadata() if self.scheduler is not None else False

    def next_deadline(self) -> float | None:
        if self.scheduler is not None:
            return self.scheduler.next_deadline()
        assert self.worker is not None
        return self.worker.next_deadline()

    @property
    def num_blocks_held(self) -> int:
        return self.scheduler.num_blocks_held if self.scheduler is not None else 0

    # worker half
    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        if self.worker is not None:  # the scheduler half never needs one
            self.worker.set_wakeup(wakeup)

    def kv_cache_buffer(self, group: int, nbytes: int) -> memoryview | None:
        assert self.worker is not None
        return self.worker.kv_cache_buffer(group, nbytes)

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        assert self.worker is not None
        if isinstance(self._metadata, P2PConnectorMetadata):
            self.worker.start_load_kv(self._metadata)

    def save_kv_layer(self, layer_index: int) -> None:
        """Push mode, producer: queue layer `layer_index`'s KV of this step's pushes for the
        sender thread (never blocks); nothing otherwise."""
        assert self.worker is not None
        self.worker.push_sender.save_kv_layer(layer_index)

    def wait_for_save(self) -> None:
        """Push mode, producer: wait (deadline: transfer_timeout) for this step's writes."""
        assert self.worker is not None
        self.worker.push_sender.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.worker is not None
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def get_load_errors(self) -> dict[str, str]:
        assert self.worker is not None
        return self.worker.get_load_errors()

    def get_request_bytes(self) -> dict[str, dict[str, float]]:
        assert self.worker is not None
        return self.worker.get_request_bytes()

    def get_stats(self) -> tuple[dict[str, float], list[float]]:
        assert self.worker is not None
        return self.worker.get_stats()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
