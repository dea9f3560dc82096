"""Transfer engine interface: the data plane that moves KV bytes between engines.

The producer registers memory regions (its KV cache tensors) and serves reads; the consumer
submits a batch of reads (region, offset, length -> local buffer) with a deadline. Engines are
chosen by name (`tcp`, `shm`, `mooncake`); the control plane (handshake, notifications, leases)
is the connector's and is the same for every engine.

Push mode runs the other way: the consumer serves writes (`set_write_handler`) and the producer
writes (`write`). tcp carries the bytes on its own stream, asked of the handler first; the
one-sided engines (shm, mooncake) reserve every write with the consumer's handler before
writing and commit it after (push_control.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Grant = tuple[str, str]
"""(request id, nonce) of the producer's grant a read belongs to."""

Authorizer = Callable[[Grant | None, str, list[tuple[int, int]]], str | None]
"""Producer side: (grant, region, [(offset, length)]) -> None to serve the ranges, or why not.
Push mode, consumer side: the same signature decides whether to accept a write."""

WriteDone = Callable[[Grant, str, list[tuple[int, int]], bool], None]
"""Push mode, consumer side: an accepted write (grant, region, [(offset, length)]) ended: True =
all its bytes landed, False = the stream broke (its ranges hold undefined bytes)."""


@dataclass(frozen=True)
class ReadOp:
    """Copy `length` bytes at `offset` of the peer's region `region` into `dest`."""

    region: str
    offset: int
    length: int
    dest: memoryview


def buffer_address(view: memoryview) -> int:
    """Address of a writable buffer's first byte."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))


def coalesce(ops: list[ReadOp]) -> list[ReadOp]:
    """Merge consecutive ops whose source ranges and destinations are both adjacent (one large
    copy instead of many block-sized ones). Order is kept; nothing is merged across regions."""
    import ctypes

    out: list[ReadOp] = []
    run_start: ReadOp | None = None
    run_len = 0
    run_addr = 0
    for op in ops:
        addr = buffer_address(op.dest)
        if (run_start is not None and op.region == run_start.region
                and op.offset == run_start.offset + run_len and addr == run_addr + run_len):
            run_len += op.length
            continue
        if run_start is not None:
            out.append(_merged(run_start, run_len, run_addr, ctypes))
        run_start, run_len, run_addr = op, op.length, addr
    if run_start is not None:
        out.append(_merged(run_start, run_len, run_addr, ctypes))
    return out


def _merged(first: ReadOp, length: int, addr: int, ctypes: Any) -> ReadOp:
    if length == first.length:
        return first
    dest = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
    return ReadOp(first.region, first.offset, length, dest)


@dataclass(frozen=True)
class WriteOp:
    """Push mode: copy `length` bytes of `src` to `offset` of the peer's region `region`."""

    region: str
    offset: int
    length: int
    src: memoryview


class TransferError(RuntimeError):
    """A read failed or missed its deadline (the destination content is undefined)."""


class TransferEngine(ABC):
    """One engine instance per process and role.

    Threading: `register_region`, `start` and `peer_info` are called once at start-up from the
    engine loop thread; `read` is called from the connector's transfer threads and blocks until
    every op is done or the deadline passes; servers run on their own threads.
    """

    name = "base"

    @abstractmethod
    def register_region(self, name: str, buffer: memoryview) -> None:
        """Expose a byte buffer (a KV cache tensor) to peers under `name`."""

    def register_local(self, name: str, buffer: memoryview) -> None:
        """Consumer side: a buffer reads will land in (engines that must pin it)."""

    def start(self, host: str, advertise_host: str | None = None) -> None:
        """Start serving registered regions (producer side) on `host`; peer_info names
        `advertise_host` (default: `host`), the address consumers connect to."""

    def set_authorizer(self, authorizer: Authorizer) -> None:
        """Producer side, before `start`: engines that serve reads themselves (tcp) ask
        `authorizer` before serving each read and refuse it when it returns a reason. One-sided
        engines (shm, mooncake) cannot: they are for same-host / trusted networks only."""

    def forget_peer(self, peer: dict[str, Any]) -> None:
        """Consumer side, any thread: drop cached connections or mappings to `peer` (after a
        failure, e.g. the producer restarted)."""

    @abstractmethod
    def peer_info(self) -> dict[str, Any]:
        """What a consumer needs to read this engine's regions (sent in the handshake)."""

    def peer_refusal(self, peer: dict[str, Any]) -> str | None:
        """Consumer side, any thread, at the handshake (where the producer's peer_info is first
        seen, before any claim or read): why this engine cannot read from `peer` at all (e.g. a
        same-host engine and a producer on another host), or None. Never blocks."""
        return None

    @abstractmethod
    def read(
        self, peer: dict[str, Any], ops: list[ReadOp], deadline: float, grant: Grant | None = None
    ) -> int:
        """Perform the reads; returns bytes read.

        Args:
            peer: the producer's peer_info().
            ops: reads, in any order.
            deadline: time.monotonic() by which all must be done (the whole read, not each
                network call).
            grant: the producer grant the reads belong to (sent to engines that check it).

        Raises:
            TransferError: unreachable peer, bad region/offset, or deadline passed.
        """

    def set_write_handler(self, authorize: Authorizer, on_written: WriteDone) -> None:
        """Push mode, consumer side, before `start`: accept writes into registered regions,
        each only when `authorize(grant, region, ranges)` returns None (else it is refused with
        that reason, no byte written); `on_written` is called (server thread) once for every
        accepted write when it ended, saying whether all its bytes landed (one-sided engines:
        when the producer committed it, or not landed when its reservation broke or timed out).
        Engines that cannot serve writes ignore it (every push to them fails)."""

    def write_address(self) -> tuple[str, int] | None:
        """Push mode, consumer side, after `start` with a write handler set: the (host, port)
        producers send their writes to (tcp: the data server; shm, mooncake: the push control
        server that reserves them), put into grants; None when this engine serves no writes."""
        return None

    def write(
        self, peer: dict[str, Any], ops: list[WriteOp], deadline: float, grant: Grant | None = None
    ) -> int:
        """Push mode, producer side (the connector's sender thread; blocks): write `ops` into
        the peer's registered regions under the consumer's `grant` (request id, nonce).
        Returns bytes written.

        Raises:
            TransferError: this engine cannot push, the peer refused (outside its window, stale
                nonce), it is unreachable, or the deadline passed.
        """
        raise TransferError(f"the {self.name} transfer engine cannot push (write) KV")

    def close(self) -> None:
        """Stop servers, release mappings."""
