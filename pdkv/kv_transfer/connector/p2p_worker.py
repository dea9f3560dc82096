"""Worker half of the P2P connector: registers the KV cache with the transfer engine (tcp | shm |
mooncake) and joins the producer side (control server, held blocks; p2p_producer.py) and the
consumer side (pulls, notices; p2p_consumer.py), which report through one WorkerResults."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdkv.kv_transfer.connector.p2p_consumer import ConsumerSide
from pdkv.kv_transfer.connector.p2p_messages import P2PConnectorMetadata
from pdkv.kv_transfer.connector.p2p_producer import ProducerSide
from pdkv.kv_transfer.connector.p2p_push import LayerSlot, PushReceiver, PushSender
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.connector.startup import Address
from pdkv.kv_transfer.engine.factory import create_transfer_engine

if TYPE_CHECKING:
    import torch

    from pdkv.cache.kv_layout import KVLayout
    from pdkv.kv_transfer.connector.spec import P2PSpec

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def advertised_host(bind_host: str, configured: str | None) -> str:
    """The host consumers are told to connect to: `configured` (kv_advertise_host) when set,
    else the bind host, else (a wildcard bind) this machine's resolved host name, falling back
    to 127.0.0.1; never a wildcard address."""
    if configured:
        if configured in WILDCARD_HOSTS:
            raise ValueError(
                f"kv_advertise_host must be an address peers can connect to, not {configured!r}"
            )
        return configured
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = "127.0.0.1"
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    logger.warning("kv_host %r is a wildcard: advertising %s to consumers (set kv_advertise_host "
                   "in kv_connector_extra_config to choose)", bind_host, host)
    return host


class P2PConnectorWorker:
    """Args:
        spec: the connector; `spec.p2p` gives transfer, kv_host (bind), kv_advertise_host
            (what consumers connect to; default kv_host, never a wildcard), kv_port,
            transfer_timeout, kv_lease_duration, and the bounds read by the producer and
            consumer sides.
        layout: this engine's KV layout.
        control_address: shared [host, port] list the scheduler half reads (filled here).
        dcp_rank, dcp_size: this worker's DCP rank and size (a consumer rank pulls only the
            blocks of its shard; p2p_consumer.py).
        rank, world_size: this worker's global rank and the engine's worker count (every rank
            reads a grant; default dcp_rank / dcp_size). A configured kv_port or transfer_port
            (non-zero) is rank 0's: rank r listens on port + r (each rank of a multi-rank
            producer runs its own control and data servers).
        slots: per model layer, its (group, index in group, layers in group) (push mode).
        push_address: shared [host, port] list: push mode, consumer: its data server's address
            (filled here at register_kv_caches; the scheduler half puts it into grants).
    """

    def __init__(self, spec: P2PSpec, layout: KVLayout, control_address: Address,
                 dcp_rank: int = 0, dcp_size: int = 1, rank: int | None = None,
                 world_size: int | None = None, slots: list[LayerSlot] | None = None,
                 push_address: Address | None = None) -> None:
        s = spec.p2p
        self.spec = spec
        self.layout = layout
        self.transfer_name = s.transfer
        offset = (dcp_rank if rank is None else rank)
        self.engine = create_transfer_engine(
            s.transfer, port=s.transfer_port + offset if s.transfer_port else 0,
            max_connections=s.kv_server_max_connections, idle_timeout=s.kv_server_idle_timeout,
            host=s.kv_host, mooncake_protocol=s.mooncake_protocol)
        self.host = s.kv_host
        self.advertise_host = advertised_host(self.host, s.kv_advertise_host or None)
        self.control_address = control_address
        self._regions: list[memoryview] = []
        self._block_bytes: list[int] = []
        self._wakeup: Callable[[], None] | None = None
        self.results = WorkerResults(lambda: self._wakeup)
        self.producer = ProducerSide(spec, layout, self.engine, self.results, self._block_bytes)
        self.consumer = ConsumerSide(spec, layout, self.engine, self.results, self._regions,
                                     self._block_bytes, dcp_rank, dcp_size, rank, world_size)
        self.push = s.transfer_mode == "push"
        self.push_address: Address = push_address if push_address is not None else ["", 0]
        slots = slots or []
        if self.push and len(slots) > layout.num_layers:
            raise ValueError(
                f"transfer_mode 'push' writes each model layer's KV after the layer runs; this "
                f"model keeps {len(slots) - layout.num_layers} caches beyond its "
                f"{layout.num_layers} layers (DeepSeek-V4's compressed entries, indexer keys and "
                "compressor state) that no layer pushes: use transfer_mode 'pull'")
        self.push_sender = PushSender(self.engine, self.results, self._regions,
                                      self._block_bytes, slots, s.transfer_timeout)
        per_group = [0] * (max((g for g, _, _ in slots), default=-1) + 1)
        for g, _, n in slots:
            per_group[g] = n
        self.push_receiver = PushReceiver(self.results, self._block_bytes, per_group)
        if spec.is_kv_producer:
            port = s.kv_port
            self.control_address[:] = self.producer.start(self.host, port + offset if port else 0,
                                                          self.advertise_host)

    # ---------------------------------------------------------------- memory
    def kv_cache_buffer(self, group: int, nbytes: int) -> memoryview | None:
        """Memory for group `group`'s KV cache when the transfer engine needs its own (shm: a
        producer's, read by consumers; a push-mode consumer's, written by producers)."""
        if self.transfer_name == "shm" and (self.spec.is_kv_producer or self.receives_pushes):
            from pdkv.kv_transfer.engine.shm import ShmTransferEngine

            assert isinstance(self.engine, ShmTransferEngine)
            return self.engine.allocate(f"g{group}", nbytes)
        return None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Expose (producer) or pin (consumer) the per-group KV cache tensors.

        Raises:
            ValueError: a tensor is not in CPU memory (the transfer engines read and write host
                memory only; a device KV cache is refused at start-up, not at the first pull).
        """
        import torch

        for g, t in enumerate(kv_caches):
            if t.device.type != "cpu":
                raise ValueError(
                    f"P2PConnector transfers need the KV cache in CPU memory, but group {g} is on "
                    f"{t.device}: run this engine with a CPU KV cache or without "
                    "--kv-transfer-config"
                )
        for g, t in enumerate(kv_caches):
            flat = t.view(-1).view(torch.uint8)
            view = flat.numpy().data
            self._regions.append(view)
            self._block_bytes.append(len(view) // t.shape[0])
            if self.spec.is_kv_producer or self.receives_pushes:
                self.engine.register_region(f"g{g}", view)
            if self.spec.is_kv_consumer:
                self.engine.register_local(f"g{g}", view)
        if self.receives_pushes:
            self.engine.set_write_handler(self.push_receiver.authorize,
                                          self.push_receiver.on_written)
        if self.spec.is_kv_producer or self.receives_pushes:
            self.engine.start(self.host, self.advertise_host)
        if self.receives_pushes:
            address = self.engine.write_address()
            if address is None:
                raise ValueError(f"the {self.transfer_name} transfer engine serves no writes: "
                                 "use transfer_mode 'pull'")
            self.push_address[:] = [address[0], address[1]]

    @property
    def receives_pushes(self) -> bool:
        """Push mode on a consumer: its transfer engine serves writes into granted blocks."""
        return self.push and self.spec.is_kv_consumer

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """The engine loop's wake-up callback (called when sends or loads finish)."""
        self._wakeup = wakeup

    def next_deadline(self) -> float | None:
        """Earliest time.monotonic() the engine must step for this half: a lease expiry of
        blocks held for consumers, a renewal or deadline of a pull not yet reading; or None."""
        times = [
            t
            for t in (self.producer.next_deadline(), self.consumer.next_deadline(),
                      self.push_receiver.next_deadline())
            if t is not None
        ]
        return min(times, default=None)

    # ------------------------------------------------------------ per step
    def start_load_kv(self, meta: P2PConnectorMetadata) -> None:
        self.producer.hold(meta.reqs_to_send)
        self.consumer.submit(meta.reqs_to_recv, meta.notifications)
        self.push_receiver.open(meta.windows_to_open)
        self.push_receiver.close(meta.windows_to_close)
        self.push_receiver.tokens(meta.window_tokens)
        self.push_sender.begin(meta.reqs_to_push)

    def get_finished(self) -> tuple[set[str], set[str]]:
        self.producer.expire()
        self.push_receiver.expire()
        self.consumer.tick()
        return self.results.take_finished()

    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        return self.results.take_bad_blocks()

    def get_load_errors(self) -> dict[str, str]:
        return self.results.take_errors()

    def get_stats(self) -> tuple[dict[str, float], list[float]]:
        return self.results.take_stats()

    def get_request_bytes(self) -> dict[str, dict[str, float]]:
        return self.results.take_request_bytes()

    def has_pending(self) -> bool:
        return self.producer.has_pending()

    def shutdown(self) -> None:
        self.push_sender.shutdown()
        self.producer.shutdown()
        self.consumer.shutdown()
        self.engine.close()
