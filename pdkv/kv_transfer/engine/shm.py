"""`shm` transfer engine (same host): the producer's KV cache lives in named shared memory and the
consumer copies blocks straight out of it (one memcpy per run of bytes). Reads are one-sided: any
process of the same user that learns a segment name can map all of the producer's KV cache, so
this engine is for a single trusted host (grants are checked on the control plane only).

Push mode (the P2P connector's `transfer_mode: push`) runs the other way: the consumer's KV cache
lives in shared memory too, and the producer copies each layer's bytes into it, every copy
reserved first with the consumer's write handler and committed after it (push_control.py: no
byte is copied before the consumer accepted exactly those (block, layer) ranges).

A consumer refuses, at the handshake, a producer whose `host_identity` differs from its own
(`peer_refusal`): the pull fails at once with both identities named, instead of mapping a segment
of the same name that holds other bytes or none. A pushing producer checks the consumer's
identity (sent with the acceptance) the same way before it copies."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from pdkv.kv_transfer.engine.base import (
    Authorizer,
    Grant,
    ReadOp,
    TransferEngine,
    TransferError,
    WriteDone,
    WriteOp,
    coalesce,
)
from pdkv.kv_transfer.engine.push_control import PushControlClient, PushControlServer


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    # The attaching process must not unlink the segment at exit (CPython registers every
    # attachment with the resource tracker before 3.13).
    with contextlib.suppress(Exception):  # tracker details vary across versions
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def host_identity() -> str:
    """This process's host as the shm engine counts hosts: "boot <kernel boot id> netns <inode>
    shm <device>" (parts Linux lacks are left out; no boot id: the host name instead).

    The boot id (/proc/sys/kernel/random/boot_id) names the running kernel, so two machines (or
    one machine before and after a reboot) differ. The network namespace (the inode of
    /proc/self/ns/net) counts too: addresses only mean a host through their namespace, and a
    namespace is how a host is modelled on one machine (`pdkv up --deploy FILE --netns`), so two
    engines in different namespaces are on different hosts although /dev/shm is shared; a
    deployment that puts them there must not pass its KV by shared memory. The device of /dev/shm
    tells apart containers that share a kernel and a network but not their shared memory.
    """
    parts: list[str] = []
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f"boot {f.read().strip()}")
    except OSError:
        parts.append(f"hostname {socket.gethostname()}")
    for what, path in (("netns", "/proc/self/ns/net"), ("shm", "/dev/shm")):
        try:
            st = os.stat(path)
        except OSError:
            continue
        parts.append(f"{what} {st.st_ino if what == 'netns' else st.st_dev}")
    return " ".join(parts)


class ShmTransferEngine(TransferEngine):
    """Regions are shared-memory segments created by `allocate`; names and the engine's
    `host_identity` travel in the handshake (pull) or in the consumer's acceptance of a reserved
    write (push).

    Args:
        port: push mode, consumer side: port of the push control server (0: any free port).
        max_connections: connections that server serves at once.
        idle_timeout: seconds a control connection may idle, and a reserved write may take
            before it is committed.
        host_id: this engine's host identity (default: `host_identity()`; tests set another to
            model a peer on another host).
    """

    name = "shm"

    def __init__(self, port: int = 0, max_connections: int = 64,
                 idle_timeout: float = 60.0, host_id: str | None = None) -> None:
        self.host_id = host_identity() if host_id is None else host_id
        self._owned: list[shared_memory.SharedMemory] = []
        self._names: dict[str, str] = {}  # region -> segment name
        self._sizes: dict[str, int] = {}  # registered region -> bytes
        self._attached: dict[str, shared_memory.SharedMemory] = {}
        self._port = port
        self._max_connections = max_connections
        self._idle_timeout = idle_timeout
        self._host = "127.0.0.1"
        self._write_handler: tuple[Authorizer, WriteDone] | None = None
        self._control: PushControlServer | None = None  # consumer: serves reservations
        self._client = PushControlClient()  # producer: reserves its writes

    def allocate(self, region: str, nbytes: int) -> memoryview:
        """A new zero-filled shared segment of `nbytes` for region `region` (the producer's KV
        cache tensor is built on it)."""
        shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        self._owned.append(shm)
        self._names[region] = shm.name
        assert shm.buf is not None
        return shm.buf

    def register_region(self, name: str, buffer: memoryview) -> None:
        if name not in self._names:
            raise ValueError(
                f"region {name!r} is not in shared memory: allocate it with allocate()"
            )
        self._sizes[name] = len(buffer.cast("B"))

    def set_write_handler(self, authorize: Authorizer, on_written: WriteDone) -> None:
        self._write_handler = (authorize, on_written)

    def start(self, host: str, advertise_host: str | None = None) -> None:
        """Push mode, consumer side (a write handler set): serve reservations on `host`."""
        if self._write_handler is None or self._control is not None:
            return
        self._host = advertise_host or host
        self._control = PushControlServer(self._sizes, *self._write_handler,
                                          target=self.peer_info,
                                          max_connections=self._max_connections,
                                          idle_timeout=self._idle_timeout)
        self._control.start(host, self._port)

    def peer_info(self) -> dict[str, Any]:
        return {"segments": dict(self._names), "host_id": self.host_id}

    def peer_refusal(self, peer: dict[str, Any]) -> str | None:
        """Why this engine cannot read `peer`'s shared memory: the producer is on another host
        (its `host_id` differs from this engine's, or it sent none), or None."""
        return self._other_host(peer, "producer", "consumer")

    def _other_host(self, peer: dict[str, Any], peer_role: str, my_role: str) -> str | None:
        theirs = peer.get("host_id")
        if theirs == self.host_id:
            return None
        said = f"on host [{theirs}]" if isinstance(theirs, str) and theirs else "on an unnamed host"
        return (f"the shm transfer engine moves KV through this host's shared memory, but the "
                f"{peer_role} is {said} and this {my_role} on host [{self.host_id}] (each network "
                "namespace counts as a host): use transfer 'tcp' or 'mooncake'")

    def write_address(self) -> tuple[str, int] | None:
        """Push mode, consumer side: the push control server (where reservations go)."""
        return None if self._control is None else (self._host, self._control.port)

    def _segment(self, seg_name: str) -> shared_memory.SharedMemory:
        """The peer's segment `seg_name`, mapped once."""
        shm = self._attached.get(seg_name)
        if shm is None:
            try:
                shm = _attach(seg_name)
            except (FileNotFoundError, OSError, ValueError) as e:
                raise TransferError(f"cannot map shared memory {seg_name!r}: {e}") from None
            self._attached[seg_name] = shm
        return shm

    def write(
        self, peer: dict[str, Any], ops: list[WriteOp], deadline: float, grant: Grant | None = None
    ) -> int:
        """Push mode, producer side: copy `ops` into the consumer's shared KV cache, each
        region's ops only after the consumer accepted them (`peer`: its push control server,
        {"host", "port"}).

        Raises:
            TransferError: refused (nothing copied), unreachable, a segment that cannot be
                mapped or a range outside it, or the deadline passed.
        """
        return self._client.write(peer, ops, deadline, grant, self._copy)

    def _copy(self, target: dict[str, Any], region: str, ops: list[WriteOp]) -> None:
        why = self._other_host(target, "consumer", "producer")  # (the acceptance names it)
        if why:
            raise TransferError(why)
        seg_name = dict(target.get("segments", {})).get(region)
        if not isinstance(seg_name, str):
            raise TransferError(f"peer has no shared region {region!r}")
        buf = self._segment(seg_name).buf
        assert buf is not None
        for op in ops:
            if op.offset < 0 or op.length < 0 or op.offset + op.length > len(buf):
                raise TransferError(f"range {op.offset}+{op.length} outside {seg_name!r}")
            if len(op.src.cast("B")) < op.length:
                raise TransferError(f"source of {len(op.src)} bytes is shorter than {op.length}")
        for op in ops:
            buf[op.offset : op.offset + op.length] = op.src.cast("B")[: op.length]

    def read(
        self, peer: dict[str, Any], ops: list[ReadOp], deadline: float, grant: Grant | None = None
    ) -> int:
        segments = peer.get("segments", {})
        total = 0
        for op in ops:
            if len(op.dest.cast("B")) < op.length or op.length < 0:
                raise TransferError(
                    f"destination of {len(op.dest)} bytes is shorter than {op.length}"
                )
        for op in coalesce(ops):
            if time.monotonic() > deadline:
                raise TransferError("transfer deadline passed")
            seg_name = segments.get(op.region)
            if seg_name is None:
                raise TransferError(f"peer has no shared region {op.region!r}")
            shm = self._segment(seg_name)
            assert shm.buf is not None
            if op.offset < 0 or op.offset + op.length > len(shm.buf):
                raise TransferError(f"range {op.offset}+{op.length} outside {seg_name!r}")
            op.dest.cast("B")[: op.length] = shm.buf[op.offset : op.offset + op.length]
            total += op.length
        return total

    def forget_peer(self, peer: dict[str, Any]) -> None:
        self._client.forget(peer)
        for seg_name in dict(peer.get("segments", {})).values():
            shm = self._attached.pop(seg_name, None)
            if shm is not None:
                with contextlib.suppress(BufferError):
                    shm.close()

    def close(self) -> None:
        if self._control is not None:
            self._control.stop()
        self._client.close()
        for shm in self._attached.values():
            shm.close()
        self._attached.clear()
        for shm in self._owned:
            # Unlink first: close() fails while a tensor still views the buffer.
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
            with contextlib.suppress(BufferError):
                shm.close()
        self._owned.clear()

