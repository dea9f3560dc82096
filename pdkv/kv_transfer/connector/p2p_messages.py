"""Typed messages of the P2P connector: scheduler → worker metadata and the P/D control plane."""

from __future__ import annotations

from typing import Any

import msgspec

from pdkv.kv_transfer.connector.base import KVConnectorMetadata


class RemoteEngine(msgspec.Struct, frozen=True):
    """Where a producer's control server listens."""

    engine_id: str
    host: str
    port: int


class SendSpec(msgspec.Struct):
    """Producer: hold these blocks for `lease_s` seconds (renewable) until the consumer is done."""

    request_id: str
    block_ids: tuple[list[int], ...]
    lease_s: float


class RecvSpec(msgspec.Struct):
    """Consumer: pull the producer's `remote_block_ids` into `local_block_ids` (same length per
    group), then tell the producer."""

    request_id: str
    remote: RemoteEngine
    remote_request_id: str
    local_block_ids: tuple[list[int], ...]
    remote_block_ids: tuple[list[int], ...]
    remote_layout: dict[str, Any]


class NotifySpec(msgspec.Struct):
    """Consumer: send `kind` ("release" | "renew") about a remote request."""

    remote: RemoteEngine
    remote_request_id: str
    kind: str


class P2PConnectorMetadata(KVConnectorMetadata, kw_only=True):
    reqs_to_send: list[SendSpec] = msgspec.field(default_factory=list)
    reqs_to_recv: list[RecvSpec] = msgspec.field(default_factory=list)
    notifications: list[NotifySpec] = msgspec.field(default_factory=list)


# ------------------------------------------------------------------ control plane (P's server)
class Handshake(msgspec.Struct, tag="handshake"):
    """Consumer asks for the producer's layout and data-plane address."""

    engine_id: str
    layout: dict[str, Any]


class Notify(msgspec.Struct, tag="notify"):
    """Consumer reports a request: "done" (read finished; `nbytes` read), "release" (will never
    read) or "renew" (still waiting; extend the lease)."""

    request_id: str
    kind: str
    nbytes: int = 0


ControlRequest = Handshake | Notify


class HandshakeReply(msgspec.Struct):
    ok: bool
    error: str = ""
    engine_id: str = ""
    layout: dict[str, Any] = msgspec.field(default_factory=dict)
    transfer: str = ""
    peer_info: dict[str, Any] = msgspec.field(default_factory=dict)
    block_bytes: list[int] = msgspec.field(default_factory=list)


class Ack(msgspec.Struct):
    ok: bool
    error: str = ""


LAYOUT_KEYS = ("model_digest", "dtype", "block_size", "num_layers", "num_kv_heads", "head_size", "kv_layout")


def layout_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """A message naming every differing layout field (producer's value vs consumer's), or None."""
    diffs = [
        f"{k}: producer={theirs.get(k)!r} consumer={mine.get(k)!r}"
        for k in LAYOUT_KEYS
        if mine.get(k) != theirs.get(k)
    ]
    if not diffs:
        return None
    return "KV layout mismatch between prefill and decode engines (" + "; ".join(diffs) + ")"


def send_release(host: str, port: int, request_id: str, timeout: float = 5.0) -> bool:
    """Tell a producer's control server that `request_id` will never be read (blocking; used by
    the proxy when a decode leg fails). Returns whether the producer acknowledged."""
    from pdkv.kv_transfer.wire import WireError, connect, recv_msg, send_msg

    try:
        with connect(host, port, timeout) as sock:
            send_msg(sock, Notify(request_id, "release"))
            return recv_msg(sock, Ack).ok
    except (OSError, WireError):
        return False
