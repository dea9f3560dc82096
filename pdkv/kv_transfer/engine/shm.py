"""`shm` transfer engine (same host): the producer's KV cache lives in named shared memory and the
consumer copies blocks straight out of it (one memcpy per run of bytes). Reads are one-sided: any
process of the same user that learns a segment name can map all of the producer's KV cache, so
this engine is for a single trusted host (grants are checked on the control plane only)."""

from __future__ import annotations

import contextlib
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


class ShmTransferEngine(TransferEngine):
    """Regions are shared-memory segments created by `allocate`; names travel in the handshake."""

    name = "shm"

    def __init__(self) -> None:
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
        return {"segments": dict(self._names)}

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

