"""Push mode of the P2P connector's scheduler half (`transfer_mode: push`; issue 29; vLLM's NIXL
push mode, vLLM-Ascend's layer-wise connector): D first.

Consumer (D): a request with kv_transfer_params {"do_remote_prefill": true, "transfer_mode":
"push"} is admitted like a pull (blocks for the prompt allocated through the block manager,
WAITING_FOR_REMOTE_KVS) but opens a write window instead of pulling: a `PushGrant` (its blocks
after D's local hits, a nonce, the prompt digest, D's data server, a lease) that `grant` returns
(the server's `GET /v1/kv/push_grant/{request_id}`) and the worker half enforces
(p2p_push.PushReceiver). When every layer of every granted block has landed, the request resumes
as after a pull (it recomputes the last prompt token).

Producer (P): a request whose kv_transfer_params carry "push_grant" (with do_remote_decode) pushes,
in every step that computes part of its prompt, the prompt blocks completed in that step (from its
first step: also P's prefix hits), layer by layer (`PushSpec`); P holds nothing after its prefill.

A model with a linear-state group (Gated DeltaNet) resumes on D after all n prompt tokens, as
after a pull: only the slot holding the state after n tokens moves (pushed with P's last chunk:
the grant names one D slot per linear group), and D's window completes only when P's sampled
token has arrived too (P's answer carries it as "first_token"; the proxy hands it to D,
`POST /v1/kv/push_first_token/{request_id}`, here `set_first_token`).

Sliding-window groups move only the blocks D keeps when it resumes at the last prompt token
(`window_first_block`, as a pull does): the grant names the null block (id 0; window groups'
pools reserve it) for the others, and P pushes no such pair. Full-attention, sliding-window,
MLA and linear-state groups with equal block sizes, tp 1, dcp 1; other layouts are refused at
validate_request, naming the reason.

Across block sizes (D's grant counts D's blocks; D is unchanged and accepts only whole (D block,
layer) units): P pushes a D block once it has computed every token in it (or ran the prompt's
last chunk), gathering each layer's rows of its tokens from P's blocks (`PushReblock`). Only
what the pull re-blocks: one full-attention group (plain or quantized pages, the same
kv_cache_dtype on both). Refused, naming both block sizes (`reblock_push_error`): MLA latent
blocks (no K/V rows to map by token; the pull refuses them too); sliding-window groups (P frees
the blocks before its window while it prefills, by P's block boundaries, so a D block that
starts before P's window but ends in it could need tokens P already dropped); models with more
than one KV cache group, e.g. linear-state hybrids (the pull re-blocks one group only). Each
engine reports whether it can in GET /kv_layout (`push_block_sizes`), for the proxy.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import msgspec

from pdkv.cache.block_pool import NULL_BLOCK_ID
from pdkv.cache.specs import DTYPE_BYTES, QUANTIZED_KV_CACHE_DTYPES, window_first_block
from pdkv.jsontypes import JSONObject
from pdkv.kv_transfer.connector.p2p_compat import MLA_KV_LAYOUT
from pdkv.kv_transfer.connector.p2p_messages import (
    PushGrant,
    PushReblock,
    PushSpec,
    WindowSpec,
    layout_mismatch,
    prompt_digest,
)
from pdkv.kv_transfer.connector.startup import Address

if TYPE_CHECKING:
    from pdkv.cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from pdkv.cache.kv_layout import KVLayout
    from pdkv.kv_transfer.connector.spec import P2PSpec
    from pdkv.request import Request
    from pdkv.sched.output import SchedulerOutput


def reblock_push_error(layout: KVLayout, sliding_windows: tuple[int | None, ...],
                       linear_groups: tuple[bool, ...], p_block_size: int,
                       d_block_size: int) -> str:
    """Why an engine of this KV layout and these groups cannot push between P's block size
    `p_block_size` and D's `d_block_size` (tokens per block), naming both and the reason, or ""
    (equal sizes; or one full-attention group of plain or quantized pages: re-blocked by token,
    pdkv/kv_transfer/reblock.py). Both engines have the same model and layout but the block
    size (P's validate compares the rest), so either side's answer holds for the pair."""
    if p_block_size == d_block_size:
        return ""
    pair = (f"prefill block_size={p_block_size} and decode block_size={d_block_size}: a push "
            "across block sizes")
    if layout.kv_layout == MLA_KV_LAYOUT:
        return (f"{pair} re-blocks K/V rows by token, which MLA latent blocks do not have (the "
                "pull refuses them too); use equal block sizes")
    if any(w is not None for w in sliding_windows):
        return (f"{pair} is not supported with a sliding-window group: P frees the blocks before "
                "its window by its own block boundaries while it prefills, so a decode block "
                "could need tokens P already dropped; use equal block sizes")
    if len(sliding_windows) != 1 or any(linear_groups):
        return (f"{pair} needs one full-attention KV cache group, as the pull's re-blocking "
                f"(this model has {len(sliding_windows)} groups"
                f"{', a linear-state one among them' if any(linear_groups) else ''}); use equal "
                "block sizes")
    if not token_row_bytes(layout):
        return f"{pair} does not know the token rows of kv_cache_dtype {layout.cache_dtype!r}"
    return ""


def push_block_sizes(layout: KVLayout, sliding_windows: tuple[int | None, ...],
                     linear_groups: tuple[bool, ...]) -> str:
    """GET /kv_layout's `push_block_sizes`: "any" when this engine pushes to (or takes pushes
    from) a peer of another block size (`reblock_push_error` finds nothing to refuse), else
    "equal". The proxy pushes across block sizes only when both engines say "any"."""
    other = layout.block_size * 2  # any other size: the checks do not depend on the sizes
    return "equal" if reblock_push_error(layout, sliding_windows, linear_groups,
                                         layout.block_size, other) else "any"


def token_row_bytes(layout: KVLayout) -> tuple[int, ...]:
    """Bytes of one token's K (or V) of one layer in each plane of a layer's page, in page order
    (pdkv/kv_transfer/reblock.py's formula): (local KV heads × head_size × dtype bytes,), or a
    quantized page's (heads × head_size, heads × 4): 1-byte values, then float32 scales per
    (token, head). () for a dtype of unknown size."""
    heads, head = layout.local_kv_heads, layout.head_size
    if layout.cache_dtype in QUANTIZED_KV_CACHE_DTYPES:
        return (heads * head, heads * 4)
    size = DTYPE_BYTES.get(layout.dtype, 0)
    return (heads * head * size,) if size else ()


def is_push(params: JSONObject | None) -> bool:
    """Whether kv_transfer_params ask for push mode (D's side, or P's with a grant)."""
    if not params:
        return False
    return params.get("transfer_mode") == "push" or "push_grant" in params


class PushScheduler:
    """The push-mode state of one scheduler half: D's open windows, P's pushes in progress.

    Raises:
        ValueError: push mode on a layout that cannot push (`layout_error`): the engine does not
            start, and the message names transfer_mode 'pull'.

    Args:
        spec: the connector (role, engine id; `p2p.transfer_mode`, `p2p.transfer_timeout`: the
            window's lease in seconds).
        layout: this engine's KV layout.
        block_size: tokens per block (this engine's; a producer's grant may count D's blocks
            of another size: the pushes are re-blocked, `PushReblock`).
        sliding_windows, linear_groups: per KV cache group (a window group moves the blocks D
            keeps, a linear group its state slot after the prompt).
        address: consumer: its data server [host, port] (filled by the worker half at start-up),
            put into grants.
    """

    def __init__(self, spec: P2PSpec, layout: KVLayout, block_size: int,
                 sliding_windows: tuple[int | None, ...], linear_groups: tuple[bool, ...],
                 address: Address | None = None) -> None:
        self.spec = spec
        self.enabled = spec.p2p.transfer_mode == "push"
        self.layout = layout
        self.wire_layout = layout.to_wire()
        self.block_size = block_size
        self.num_groups = len(sliding_windows)
        self.sliding_windows = sliding_windows
        self.linear_groups = linear_groups
        self.row_bytes = token_row_bytes(layout)  # pushes across block sizes gather rows
        self.address: Address = address if address is not None else ["", 0]
        self._kv: KVCacheManager | None = None
        self._grants: dict[str, PushGrant] = {}  # consumer: request id -> its open window
        self._to_open: list[WindowSpec] = []
        self._to_close: list[str] = []  # consumer: aborted requests whose window is open
        if self.enabled and self.layout_error():
            raise ValueError(self.layout_error())
        self._awaiting_token: dict[str, Request] = {}  # consumer, linear state: no token yet
        self._tokens: list[str] = []  # consumer: windows whose first token arrived
        self._pushing: dict[str, tuple[PushGrant, list[int]]] = {}  # producer: grant, [next block]

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Start-up: the block manager (a producer reads its request's block table)."""
        self._kv = kv_cache_manager

    # ------------------------------------------------------------ validation
    def layout_error(self) -> str:
        """Why this engine's layout cannot push or receive pushes, or ""."""
        if self.layout.tp != 1 or self.layout.dcp != 1:
            return (f"P2PConnector transfer_mode 'push' needs tp 1 and dcp 1 (this engine: tp "
                    f"{self.layout.tp}, dcp {self.layout.dcp}): use transfer_mode 'pull'")
        return ""

    def validate(self, request: Request, p: JSONObject) -> None:
        """Push-mode kv_transfer_params: D's {"do_remote_prefill", "transfer_mode": "push"}, or
        P's {"do_remote_decode", "push_grant": PushGrant}.

        Raises:
            ValueError: this engine is not in push mode; a grant that does not parse, is for
                another layout or prompt, or for a block size this model does not push across
                (`reblock_push_error`, naming both sizes).
        """
        if not self.enabled:  # (a push engine's layout was checked at start-up)
            raise ValueError("kv_transfer_params ask for a push but this P2PConnector has "
                             "transfer_mode 'pull' (set kv_connector_extra_config.transfer_mode)")
        if p.get("do_remote_prefill"):
            if not self.spec.is_kv_consumer:
                raise ValueError("kv_transfer_params.do_remote_prefill needs a kv_consumer engine")
            if not self.address[1]:
                raise ValueError("push mode: this engine's data server address is unknown here "
                                 "(a multi-process engine does not report it yet): use "
                                 "transfer_mode 'pull'")
            return
        if not self.spec.is_kv_producer:
            raise ValueError("kv_transfer_params.push_grant needs a kv_producer engine")
        try:
            grant = msgspec.convert(p.get("push_grant"), PushGrant)
        except msgspec.ValidationError as e:
            raise ValueError(f"kv_transfer_params.push_grant is malformed: {e}") from None
        # (D consumes, P produces; the block size is checked below: a push may re-block)
        mismatch = layout_mismatch(grant.layout, self.wire_layout, ("block_size",))
        if mismatch:
            raise ValueError(f"{mismatch}: push needs equal layouts (but the block size); "
                             "transfer_mode 'pull' converts more")
        if grant.layout.get("block_size") != grant.block_size or grant.block_size <= 0:
            raise ValueError(f"push_grant.block_size={grant.block_size!r} and its "
                             f"layout.block_size={grant.layout.get('block_size')!r} differ or "
                             "are not positive: D sends its block size in both")
        error = reblock_push_error(self.layout, self.sliding_windows, self.linear_groups,
                                   self.block_size, grant.block_size)
        if error:
            raise ValueError(error)
        if len(grant.block_ids) != self.num_groups:
            raise ValueError(f"push_grant has {len(grant.block_ids)} block lists for "
                             f"{self.num_groups} KV cache groups")
        if (grant.num_tokens != request.num_prompt_tokens
                or grant.prompt_digest != prompt_digest(request.prompt_token_ids,
                                                        request.cache_salt)):
            raise ValueError("push_grant.prompt_digest does not match this request's prompt and "
                             "cache_salt: the window belongs to another prompt")
        if not any(grant.block_ids):
            return  # D holds the whole prompt already (e.g. a KV pool hit): nothing to push
        need = -(-request.num_prompt_tokens // grant.block_size) - grant.first_block
        want = [1 if linear else need for linear in self.linear_groups]
        if [len(g) for g in grant.block_ids] != want:
            raise ValueError(f"push_grant must hold {need} blocks per group (prompt blocks from "
                             f"{grant.first_block}; one state slot per linear-state group): "
                             f"{want}, got {[len(g) for g in grant.block_ids]}")

    # ------------------------------------------------------------- consumer
    def grant(self, request_id: str) -> PushGrant | None:
        """The open window of a request admitted with do_remote_prefill and transfer_mode
        "push", or None (not admitted yet, or landed / failed)."""
        return self._grants.get(request_id)

    def open_window(self, request: Request, blocks: KVCacheBlocks,
                    num_external_tokens: int) -> None:
        """Grant P the request's new blocks (those after its local hits) for the rest of the
        prompt, and have the worker half accept writes into them (`take_windows`)."""
        first = request.num_computed_tokens // self.block_size
        need = -(-request.num_prompt_tokens // self.block_size) - first
        ids = tuple(list(g[-1:]) if linear else list(g[:need])  # (linear: the request's slot)
                    for g, linear in zip(blocks.get_block_ids(), self.linear_groups))
        if num_external_tokens <= 0:
            ids = tuple([] for _ in ids)
        for g, window in enumerate(self.sliding_windows):  # only the blocks D keeps
            keep = window_first_block(request.num_prompt_tokens - 1, self.block_size, window)
            skip = min(len(ids[g]), max(0, keep - first))
            ids[g][:skip] = [NULL_BLOCK_ID] * skip
        host, port = self.address
        grant = PushGrant(
            engine_id=self.spec.engine_id, request_id=request.request_id,
            nonce=secrets.token_hex(16), block_ids=[list(g) for g in ids], first_block=first,
            prompt_digest=prompt_digest(request.prompt_token_ids, request.cache_salt),
            host=str(host), port=int(port), lease_s=self.spec.p2p.transfer_timeout,
            num_tokens=request.num_prompt_tokens, block_size=self.block_size,
            layout=dict(self.wire_layout))
        self._grants[request.request_id] = grant
        real = tuple(g if w is None else [b for b in g if b != NULL_BLOCK_ID]
                     for g, w in zip(ids, self.sliding_windows))
        needs_token = any(self.linear_groups) and any(ids)
        if needs_token:
            self._awaiting_token[request.request_id] = request
        self._to_open.append(WindowSpec(request.request_id, grant.nonce, real, grant.lease_s,
                                        needs_token))

    def take_windows(self) -> list[WindowSpec]:
        """The windows opened since the last call (for this step's metadata)."""
        windows, self._to_open = self._to_open, []
        return windows

    def set_first_token(self, request_id: str, token: int) -> None:
        """A linear-state model: P's sampled token for D's request `request_id` (its first
        output token; the window completes once it and every pushed layer are here).

        Raises:
            ValueError: no open window of this request waits for a token (unknown request, a
                model without a linear-state group, or the token came already).
        """
        request = self._awaiting_token.pop(request_id, None)
        if request is None:
            raise ValueError(f"no open push window of request {request_id!r} waits for a first "
                             "token (unknown, landed, failed or aborted; or a model without a "
                             "linear-state group, or the token was given already)")
        p = request.kv_transfer_params if request.kv_transfer_params is not None else {}
        p["first_token"] = int(token)  # read when the load ends (KVConnectorState)
        request.kv_transfer_params = p
        self._tokens.append(request_id)

    def take_tokens(self) -> list[str]:
        """The windows whose first token arrived since the last call (this step's metadata)."""
        tokens, self._tokens = self._tokens, []
        return tokens

    def abort(self, request_id: str) -> bool:
        """D's request ended (aborted) with its window open: have the worker half close it
        (`take_closes`); True when it had one (its blocks are freed once the worker half reports
        the window ended)."""
        self._awaiting_token.pop(request_id, None)
        if self._grants.pop(request_id, None) is None:
            return False
        self._to_close.append(request_id)
        return True

    def take_closes(self) -> list[str]:
        """The windows to close since the last call (for this step's metadata)."""
        closes, self._to_close = self._to_close, []
        return closes

    def window_closed(self, request_id: str) -> None:
        """The worker half reported the request's window landed or failed."""
        self._grants.pop(request_id, None)
        self._awaiting_token.pop(request_id, None)

    # ------------------------------------------------------------- producer
    def start_pushing(self, request: Request) -> None:
        """A producer request with a (validated) push_grant: push its prompt blocks as they
        complete (a grant without blocks: none; the answer still says push)."""
        grant = msgspec.convert((request.kv_transfer_params or {})["push_grant"], PushGrant)
        self._pushing[request.request_id] = (grant, [grant.first_block])

    def push_specs(self, out: SchedulerOutput) -> list[PushSpec]:
        """This step's pushes: per request with a grant, the prompt blocks completed by this
        step's tokens (all of the rest with the prompt's last chunk), paired with the grant's
        blocks. Across block sizes the blocks are D's: one is complete when P has computed every
        token in it; the spec names P's blocks holding them (`PushReblock`)."""
        if not self._pushing:
            return []
        assert self._kv is not None, "push mode needs bind_kv_cache_manager"
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        starts.update((r.req_id, r.num_computed_tokens) for r in out.scheduled_cached_reqs)
        specs = []
        for rid, (grant, nxt) in self._pushing.items():
            n = out.num_scheduled_tokens.get(rid, 0)
            if n == 0 or rid not in starts:
                continue
            end = min(starts[rid] + n, grant.num_tokens)
            bs = grant.block_size  # D's blocks are counted (P's size where they are equal)
            done = -(-end // bs) if end >= grant.num_tokens else end // bs
            if done <= nxt[0]:
                continue
            table = self._kv.get_block_ids(rid)
            if bs != self.block_size:
                specs.append(self._reblock_spec(rid, grant, nxt[0], done, table))
                nxt[0] = done
                continue
            local: list[list[int]] = []
            remote: list[list[int]] = []
            last = end >= grant.num_tokens
            for t, g, window, linear in zip(table, grant.block_ids, self.sliding_windows,
                                            self.linear_groups):
                if linear:  # the state after all n tokens: with the last chunk, once
                    pairs = list(zip(t[-1:], g)) if last else []
                else:
                    pairs = [(p, d) for p, d in zip(t[nxt[0]:done],
                                                    g[nxt[0] - grant.first_block:
                                                      done - grant.first_block])
                             if window is None or d != NULL_BLOCK_ID]  # (blocks D drops)
                local.append([p for p, _ in pairs])
                remote.append([d for _, d in pairs])
            specs.append(PushSpec(rid, grant, tuple(local), tuple(remote)))
            nxt[0] = done
        return specs

    def _reblock_spec(self, rid: str, grant: PushGrant, first: int, done: int,
                      table: tuple[list[int], ...]) -> PushSpec:
        """Across block sizes (one full-attention group, validated): D's blocks of prompt block
        indices [first, done) (D's block size), every token of which P has computed after this
        step, and P's blocks holding those tokens."""
        d_bs, p_bs = grant.block_size, self.block_size
        stop = min(done * d_bs, grant.num_tokens)
        p_first = first * d_bs // p_bs
        local = [list(table[0][p_first : -(-stop // p_bs)])]
        remote = [list(grant.block_ids[0][first - grant.first_block : done - grant.first_block])]
        reblock = PushReblock(p_bs, d_bs, p_first, first, grant.num_tokens, self.row_bytes)
        return PushSpec(rid, grant, tuple(local), tuple(remote), (reblock,))

    def finished(self, request: Request) -> JSONObject | None:
        """A producer request ended: the kv_transfer_params of its answer (every push of its
        steps ended in wait_for_save; nothing is held; a linear-state model's carry P's
        sampled token as "first_token", for D), or None when it was not pushing."""
        pushed = self._pushing.pop(request.request_id, None)
        if pushed is None:
            return None
        params: JSONObject = {"do_remote_prefill": False, "do_remote_decode": False,
                              "transfer_mode": "push", "remote_engine_id": self.spec.engine_id,
                              "push_request_id": pushed[0].request_id}
        if any(self.linear_groups) and request.output_token_ids:
            params["first_token"] = int(request.output_token_ids[0])
        return params

    def has_pending_metadata(self) -> bool:
        return bool(self._to_open or self._to_close or self._tokens)
