"""`shm` transfer engine (same host): the producer's KV cache lives in named shared memory and the
consumer copies blocks straight out of it (one memcpy per run of bytes). Reads are one-sided: any
process of the same user that learns a segment name can map all of the producer's KV cache, so
this engine is for a single trusted host (grants are checked on the control plane only).

A consumer refuses, at the handshake, a producer whose `host_identity` differs from its own
(`peer_refusal`): the pull fails at once with both identities named, instead of mapping a segment
of the same name that holds other bytes or none."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from pdkv.kv_transfer.engine.base import Grant, ReadOp, TransferEngine, TransferError, coalesce


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
    """Regions are shared-memory segments created by `allocate`; names and the producer's
    `host_identity` travel in the handshake.

    Args:
        host_id: this engine's host identity (default: `host_identity()`; tests set another to
            model a peer on another host).
    """

    name = "shm"

    def __init__(self, host_id: str | None = None) -> None:
        self.host_id = host_identity() if host_id is None else host_id
        self._owned: list[shared_memory.SharedMemory] = []
        self._names: dict[str, str] = {}  # region -> segment name
        self._attached: dict[str, shared_memory.SharedMemory] = {}

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

    def peer_info(self) -> dict[str, Any]:
        return {"segments": dict(self._names), "host_id": self.host_id}

    def peer_refusal(self, peer: dict[str, Any]) -> str | None:
        """Why this engine cannot read `peer`'s shared memory: the producer is on another host
        (its `host_id` differs from this engine's, or it sent none), or None."""
        theirs = peer.get("host_id")
        if theirs == self.host_id:
            return None
        said = f"on host [{theirs}]" if isinstance(theirs, str) and theirs else "on an unnamed host"
        return (f"the shm transfer engine reads KV from this host's shared memory, but the "
                f"producer is {said} and this consumer on host [{self.host_id}] (each network "
                "namespace counts as a host): use transfer 'tcp' or 'mooncake'")

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
            shm = self._attached.get(seg_name)
            if shm is None:
                try:
                    shm = _attach(seg_name)
                except (FileNotFoundError, OSError) as e:
                    raise TransferError(f"cannot map shared memory {seg_name!r}: {e}") from None
                self._attached[seg_name] = shm
            assert shm.buf is not None
            if op.offset < 0 or op.offset + op.length > len(shm.buf):
                raise TransferError(f"range {op.offset}+{op.length} outside {seg_name!r}")
            op.dest.cast("B")[: op.length] = shm.buf[op.offset : op.offset + op.length]
            total += op.length
        return total

    def forget_peer(self, peer: dict[str, Any]) -> None:
        for seg_name in dict(peer.get("segments", {})).values():
            shm = self._attached.pop(seg_name, None)
            if shm is not None:
                with contextlib.suppress(BufferError):
                    shm.close()

    def close(self) -> None:
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

