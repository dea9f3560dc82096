"""Typed messages of the P2P connector: scheduler → worker metadata and the P/D control plane.

A producer holds a request's blocks under a *grant* identified by (engine id, request id, nonce):
the nonce is random per held request and travels in kv_transfer_params (`remote_nonce`), so a
notice or read can only ever apply to the grant it was issued for, never to a later request that
reuses the id. `prompt_digest` (sha256 over the prompt's token ids and cache_salt) binds the grant
to its prompt: the consumer compares it with its own prompt's digest, and the producer checks the
consumer's digest again before any byte is read.

Consumers with several ranks: every rank of the decode engine pulls what it stores (under DCP the
producer blocks of its shard, block k on DCP rank k % N when the interleave equals the block size;
under TP its KV heads), so a grant has `readers` = the consumer's world size; each rank claims it
and says "done" with its global rank as `reader`, and the producer frees the blocks only when all
readers said "done" (or any one said "release").

Producers with several TP ranks (issue 12): each P rank runs its own control server and holds its
KV heads of the grant's blocks (the same ids on every rank); kv_transfer_params carry P's
`tp_size` and `endpoints` (one [host, port] per P rank, rank order). A consumer rank contacts
only the P ranks it reads heads from (pdkv/kv_transfer/reshard.py, plan_producer_readers), so a
P rank's grant has `readers` = the consumer ranks that contact it, each naming its global rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import msgspec

from pdkv.jsontypes import as_int
from pdkv.kv_transfer.connector.base import KVConnectorMetadata


class RemoteEngine(msgspec.Struct, frozen=True):
    """Where a producer's control server listens."""

    engine_id: str
    host: str
    port: int


class SendSpec(msgspec.Struct):
    """Producer: hold these blocks for `lease_s` seconds (renewable) until the consumer is done,
    under the grant (request_id, nonce) for the prompt whose digest is `prompt_digest`."""

    request_id: str
    block_ids: tuple[list[int], ...]
    lease_s: float
    nonce: str = ""
    prompt_digest: str = ""


class RecvSpec(msgspec.Struct):
    """Consumer: pull the producer's `remote_block_ids` into `local_block_ids` (same length per
    group), then tell the producer. Re-blocking: when `remote_block_size` (tokens per producer
    block; 0 = the same as this engine's) differs, the lists pair nothing: they are the producer's
    and this engine's blocks covering tokens [first_token, end_token), whose first blocks have
    indices `remote_first_block` and first_token // this engine's block size, and the worker plans
    per-token copies (pdkv/kv_transfer/reblock.py)."""

    request_id: str
    remote: RemoteEngine
    remote_request_id: str
    local_block_ids: tuple[list[int], ...]
    remote_block_ids: tuple[list[int], ...]
    remote_layout: dict[str, object]  # the producer's layout (wire form)
    remote_nonce: str = ""
    prompt_digest: str = ""  # this (consumer) engine's own digest of the request's prompt
    remote_first_block: int = 0  # index of remote_block_ids[g][0] in the producer's grant
    error: str = ""  # set: refuse the load without contacting the producer (a load error)
    remote_block_size: int = 0  # the producer's block size when it differs from this engine's
    first_token: int = 0  # re-blocking: the token range to move
    end_token: int = 0
    # Per group, the index of remote_block_ids[g][0] in the producer's grant when it differs by
    # group (sliding-window groups skip the blocks before the window); () = remote_first_block.
    group_first_blocks: tuple[int, ...] = ()
    # A producer at tp > 1: the control server of each of its TP ranks (rank order; every rank
    # holds its KV heads of the same block ids); () = `remote` alone (a producer at tp 1).
    remote_ranks: tuple[RemoteEngine, ...] = ()


class NotifySpec(msgspec.Struct):
    """Consumer: send `kind` ("release" | "renew") about a remote request."""

    remote: RemoteEngine
    remote_request_id: str
    kind: str
    remote_nonce: str = ""


class PushGrant(msgspec.Struct, frozen=True):
    """Push mode: the write window D's scheduler half opened for one of its requests (D first:
    vLLM-Ascend's layer-wise connector; vLLM's NIXL push mode). P receives it in the prefill
    request's kv_transfer_params["push_grant"] and writes prompt block k of every layer into
    D's `block_ids[g][k - first_block]` with the grant (request_id, nonce); D accepts writes only
    there, each (block, layer) once, until `lease_s` seconds after it opened the window.

    Attributes:
        engine_id: D's engine id.
        request_id: D's request id (the grant's name on D's data server).
        nonce: random per window (a write with another nonce is refused and counted).
        block_ids: per KV cache group, D's blocks for prompt blocks first_block .. (ascending).
        first_block: index of the first prompt block D lacks (its local prefix hits precede).
        prompt_digest: sha256 of D's prompt and cache_salt (`prompt_digest`); P refuses a grant
            whose digest is not its own prompt's.
        host, port: D's data server receiving the writes (tcp transfer engine), or D's push
            control server reserving them (shm, mooncake: engine/push_control.py).
        lease_s: seconds D keeps the window open from when it opened it.
        num_tokens: the prompt's token count.
        block_size: tokens per block on D (P's may differ where P re-blocks its pushes:
            `PushReblock`; a grant counts D's blocks, each written as whole (block, layer)
            units).
        layout: D's KV layout (wire form), compared by P as a handshake would (its
            block_size: D's, equal to `block_size`).
    """

    engine_id: str
    request_id: str
    nonce: str
    block_ids: list[list[int]]
    first_block: int
    prompt_digest: str
    host: str
    port: int
    lease_s: float
    num_tokens: int
    block_size: int
    layout: dict[str, object]


class PushReblock(msgspec.Struct, frozen=True):
    """Push mode across block sizes, one KV cache group of one step's `PushSpec`: D's blocks
    `remote_block_ids[g]` (prompt block indices d_first_block, d_first_block + 1, ... of D's
    block size) and P's blocks `local_block_ids[g]` (indices p_first_block, ... of P's) that
    hold their tokens. P's worker gathers, per D block and layer, the K and V rows of its tokens
    into one buffer of D's per-layer unit (2 × d_block_size × Σ row_bytes bytes) and writes it
    as one whole (block, layer) unit (pdkv/kv_transfer/reblock.py, `plan_unit_gather`).

    Attributes:
        p_block_size, d_block_size: tokens per block on P and on D.
        p_first_block: prompt block index (P's block size) of local_block_ids[g][0].
        d_first_block: prompt block index (D's block size) of remote_block_ids[g][0].
        num_tokens: the prompt's tokens (rows past it in D's last block are not P's: zeros).
        row_bytes: bytes of one token's K (or V) of one layer in each plane of a layer's page,
            in page order: (heads × head_size × dtype bytes,), or a quantized page's (heads ×
            head_size, heads × 4) (1-byte values, then float32 scales).
    """

    p_block_size: int
    d_block_size: int
    p_first_block: int
    d_first_block: int
    num_tokens: int
    row_bytes: tuple[int, ...]


class PushSpec(msgspec.Struct):
    """Push mode, P's worker half, one step: after each layer's forward, write that layer's KV of
    `local_block_ids[g][i]` into D's `remote_block_ids[g][i]` under `grant` (the prompt blocks
    that became complete in this step; the last, partial one with the prompt's last chunk).
    With `reblock` (one per group; P's and D's block sizes differ) the lists pair nothing: they
    are D's blocks complete after this step and P's blocks holding their tokens (`PushReblock`).
    """

    request_id: str  # P's
    grant: PushGrant
    local_block_ids: tuple[list[int], ...]
    remote_block_ids: tuple[list[int], ...]
    reblock: tuple[PushReblock, ...] = ()  # () = equal block sizes: whole blocks, zero-copy


class WindowSpec(msgspec.Struct):
    """Push mode, D's worker half: accept writes for grant (request_id, nonce) into
    `block_ids` (per group) until `lease_s` seconds from now; then the load fails. With
    `needs_token` (a linear-state model) the load also waits for P's first token
    (`window_tokens` of a later step's metadata)."""

    request_id: str
    nonce: str
    block_ids: tuple[list[int], ...]
    lease_s: float
    needs_token: bool = False


class P2PConnectorMetadata(KVConnectorMetadata, kw_only=True):
    reqs_to_send: list[SendSpec] = msgspec.field(default_factory=list)
    reqs_to_recv: list[RecvSpec] = msgspec.field(default_factory=list)
    notifications: list[NotifySpec] = msgspec.field(default_factory=list)
    reqs_to_push: list[PushSpec] = msgspec.field(default_factory=list)
    windows_to_open: list[WindowSpec] = msgspec.field(default_factory=list)
    windows_to_close: list[str] = msgspec.field(default_factory=list)  # aborted requests' ids
    window_tokens: list[str] = msgspec.field(default_factory=list)  # first token arrived (ids)


# ------------------------------------------------------------------ control plane (P's server)
class Handshake(msgspec.Struct, tag="handshake"):
    """Consumer asks for the producer's layout and data-plane address."""

    engine_id: str
    layout: dict[str, object]  # the consumer's layout (wire form)


class Notify(msgspec.Struct, tag="notify"):
    """Consumer reports on grant (request_id, nonce): "done" (read finished; `nbytes` read),
    "release" (will never read) or "renew" (still waiting; extend the lease). `engine_id` is the
    producer the consumer means (a restarted producer with another id refuses). A "done" names its
    `reader` (the consumer's global rank) of `readers` (the consumer's world size)."""

    request_id: str
    kind: str
    nbytes: int = 0
    nonce: str = ""
    engine_id: str = ""
    reader: int = 0
    readers: int = 1


class Claim(msgspec.Struct, tag="claim"):
    """Consumer is about to read grant (request_id, nonce) for the prompt whose digest is
    `prompt_digest`: the producer checks both, renews the lease and opens the grant to reads.
    `readers`: how many consumer ranks read this grant (the consumer's world size; the grant ends
    after "done" from each), `reader`: which one this is (its global rank). `incarnation`: the
    producer incarnation the consumer's handshake saw ("" = not said); a producer that restarted
    since refuses the claim at once instead of waiting for a grant it will never register."""

    request_id: str
    nonce: str
    prompt_digest: str
    engine_id: str = ""
    readers: int = 1
    reader: int = 0
    incarnation: str = ""


ControlRequest = Handshake | Notify | Claim


class HandshakeReply(msgspec.Struct):
    ok: bool
    error: str = ""
    engine_id: str = ""
    layout: dict[str, object] = msgspec.field(default_factory=dict)  # wire form
    transfer: str = ""
    peer_info: dict[str, object] = msgspec.field(default_factory=dict)  # TransferEngine.peer_info
    block_bytes: list[int] = msgspec.field(default_factory=list)
    incarnation: str = ""  # random per producer start: a change means handshake again


class ClaimReply(msgspec.Struct):
    ok: bool
    error: str = ""
    block_ids: list[list[int]] = msgspec.field(default_factory=list)  # the grant's, per group
    incarnation: str = ""


class Ack(msgspec.Struct):
    ok: bool
    error: str = ""


LAYOUT_KEYS = (
    "model_digest",
    "dtype",
    "block_size",
    "num_layers",
    "num_kv_heads",
    "head_size",
    "kv_layout",
    "kv_cache_dtype",
)
LAYOUT_DEFAULTS = {"kv_cache_dtype": "auto"}
"""Value of a LAYOUT_KEYS field a layout may omit (one published before the field existed)."""
CONVERTIBLE_KEYS = ("block_size", "kv_cache_dtype")
"""Layout fields the P2P connector converts (re-blocking; a quantized producer's KV dequantized
on arrival into an unquantized consumer); every other LAYOUT_KEYS field is identity: a
difference refuses (docs/ARCHITECTURE.md, "Three decisions" §3)."""


def layout_mismatch(mine: Mapping[str, object], theirs: Mapping[str, object],
                    convertible: tuple[str, ...] = CONVERTIBLE_KEYS) -> str | None:
    """A message naming every differing layout field (producer's value vs consumer's) except the
    `convertible` ones, or None. See `conversion_error` for what converting needs."""
    def get(layout: Mapping[str, object], k: str) -> object:
        return layout.get(k, LAYOUT_DEFAULTS.get(k))

    diffs = [
        f"{k}: producer={get(theirs, k)!r} consumer={get(mine, k)!r}"
        for k in LAYOUT_KEYS
        if k not in convertible and get(mine, k) != get(theirs, k)
    ]
    if not diffs:
        return None
    return "KV layout mismatch between prefill and decode engines (" + "; ".join(diffs) + ")"


def conversion_error(mine: Mapping[str, object], theirs: Mapping[str, object]) -> str | None:
    """Why the consumer (`mine`) cannot convert the producer's (`theirs`) block size or KV cache
    dtype, naming both values, or None (equal values; a consumer without DCP: re-blocking maps by
    token; a quantized producer into an unquantized consumer: dequantized on arrival, lossless).
    A producer at tp > 1 (its layout's tp_size) takes neither a block size change nor a DCP
    consumer (the decode engine's own check: `p2p_compat.producer_tp_error`)."""
    p_dt = theirs.get("kv_cache_dtype", LAYOUT_DEFAULTS["kv_cache_dtype"])
    d_dt = mine.get("kv_cache_dtype", LAYOUT_DEFAULTS["kv_cache_dtype"])
    if p_dt != d_dt and d_dt != "auto":
        return (
            "KV layout mismatch between prefill and decode engines (kv_cache_dtype: "
            f"producer={p_dt!r} consumer={d_dt!r}): only a quantized producer into a decode "
            "engine with "
            "kv_cache_dtype='auto' converts (dequantized on arrival); re-quantizing would not "
            "give what the decode engine computes itself"
        )
    if p_dt != d_dt and mine.get("block_size") != theirs.get("block_size"):
        return (
            f"producer kv_cache_dtype={p_dt!r} into decode kv_cache_dtype={d_dt!r} with "
            f"block_size {theirs.get('block_size')} -> {mine.get('block_size')}: dequantizing and "
            "re-blocking at once is not supported"
        )
    p_tp = theirs.get("tp_size", 1)
    if isinstance(p_tp, int) and p_tp > 1:  # one endpoint per P rank: whole blocks per head slice
        if as_int(mine.get("dcp_size", 1)) > 1:
            return (
                f"a prefill engine at tp_size={p_tp} into a DCP decode engine "
                f"(decode_context_parallel_size={mine.get('dcp_size')}) is not supported: P must "
                "run tp 1 for P/D into DCP"
            )
        if mine.get("block_size") != theirs.get("block_size"):
            return (
                f"a prefill engine at tp_size={p_tp} with block_size={theirs.get('block_size')} "
                f"and decode block_size={mine.get('block_size')}: re-sharding from a multi-rank "
                "producer and re-blocking at once is not supported"
            )
    if mine.get("block_size") == theirs.get("block_size"):
        return None
    dcp = as_int(mine.get("dcp_size", 1))
    if dcp > 1:
        return (
            f"decode block_size={mine.get('block_size')} (per rank, dcp_size={dcp}) differs from "
            f"the producer's block_size={theirs.get('block_size')}: re-blocking into a DCP decode "
            "engine is not supported"
        )
    return None


def params_layout(p: Mapping[str, object]) -> Mapping[str, object]:
    """The producer's layout (wire form) in kv_transfer_params `p`; {} when absent or not an
    object."""
    layout = p.get("layout")
    return layout if isinstance(layout, dict) else {}


_digest_encoder = msgspec.msgpack.Encoder()


def prompt_digest(token_ids: Sequence[int], cache_salt: str | None) -> str:
    """Hex sha256 over a canonical msgpack of (token ids, cache_salt): what a grant's KV was
    computed from. Pure; equal on every engine for the same prompt and salt, whatever the block
    size."""
    payload = _digest_encoder.encode(["pdkv.prompt.v1", list(token_ids), cache_salt or ""])
    return hashlib.sha256(payload).hexdigest()


def send_release(
    host: str, port: int, request_id: str, timeout: float = 5.0, nonce: str = ""
) -> bool:
    """Tell a producer's control server that grant (`request_id`, `nonce`) will never be read
    (blocking; used by the proxy when a decode leg fails). Returns whether the producer
    acknowledged (a wrong or missing nonce is refused: the lease then bounds the hold)."""
    from pdkv.kv_transfer.wire import WireError, connect, recv_msg, send_msg

    try:
        with connect(host, port, timeout) as sock:
            send_msg(sock, Notify(request_id, "release", nonce=nonce))
            return recv_msg(sock, Ack).ok
    except (OSError, WireError):
        return False
