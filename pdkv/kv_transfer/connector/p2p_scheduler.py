"""Scheduler half of the P2P connector (pull model, as vLLM's NixlConnector).

Producer (kv_producer): a request that arrives with `do_remote_decode` runs its prefill (capped at
max_tokens=1); when it finishes, its blocks are held (delay_free) and kv_transfer_params tell the
consumer where to read them. Consumer (kv_consumer): a request with `do_remote_prefill` gets
blocks for its whole prompt, waits in WAITING_FOR_REMOTE_KVS while the worker pulls the blocks,
then recomputes only the last prompt token (which yields the first output token: D samples it;
P's sampled token is dropped, as in vLLM). A model with a linear-attention state group instead
moves, per linear group, only the slot holding the state after all n prompt tokens, and P's
kv_transfer_params carry its sampled token ("first_token"), which D appends as its first output
token before decoding from n (`_last_slot_only`; docs/ARCHITECTURE.md "State groups").

Identity: P issues every held request a random `remote_nonce` and the `prompt_digest` of its
prompt (token ids + cache_salt); D compares that digest with its own prompt's before pulling, and
a mismatch is a load error handled by kv_load_failure_policy (nothing is read, P is not told).

P/D into DCP: a consumer with decode context parallelism N (layout "dcp_size") has logical blocks
of block_size × N tokens (this half's `block_size`), each stored as N physical blocks of P's block
size under the same block id, one per DCP rank (interleave = block size). The RecvSpec maps P's
block K0 + i (K0 = num_computed_tokens // P's block size) to the logical block holding it,
D_block_table[(K0 + i) // N]; each DCP rank's worker half reads the blocks of its shard. P must be
tp 1, dcp 1, and every D rank must store all of P's KV heads in blocks of P's size.

Re-sharding (issue 12): a consumer at tp > 1 without DCP whose ranks each store a subset of P's
KV heads (tp 1) gets the same one-to-one block map; each rank's worker half reads only its heads
(pdkv/kv_transfer/reshard.py). Ranks storing all of P's heads (KV replicated over TP) read whole
blocks. Re-sharding combined with DCP or with a block size change is refused, naming both.

Producer at tp > 1 (issue 12): every P rank holds its KV heads of the request's blocks (the same
ids on every rank) behind its own control server; kv_transfer_params carry `endpoints`, one
[host, port] per P rank (rank order; `remote_host` / `remote_port` are rank 0's), P's `tp_size`
and its layout (num_kv_heads is the model's). A consumer without DCP and with P's block size gets
the one-to-one block map plus every P rank's control address (RecvSpec.remote_ranks); its worker
halves read each head from a P rank holding it (plan_head_reads). Notices go to every P rank.

Re-blocking: a producer whose block size differs (a convertible layout field; every identity
field still refuses) is accepted when this engine has no DCP and one KV cache group: the RecvSpec
carries P's blocks covering [F, prompt end) (F = this engine's local hits, a multiple of its
block size), this engine's blocks for that range, the token range and P's block size; the worker
half plans per-token copies by absolute token position (pdkv/kv_transfer/reblock.py).

Push mode (`transfer_mode: push`; issue 29): D first; its windows and P's pushes are
`PushScheduler`'s (p2p_push_scheduler.py), which this half asks at each hook.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from pdkv.cache.block_pool import NULL_BLOCK_ID
from pdkv.cache.specs import window_first_block
from pdkv.jsontypes import JSONObject
from pdkv.kv_transfer.connector.base import KVConnectorOutput
from pdkv.kv_transfer.connector.p2p_compat import (
    linear_state_error,
    params_consistency_error,
    shard_error,
)
from pdkv.kv_transfer.connector.p2p_messages import (
    NotifySpec,
    P2PConnectorMetadata,
    PushGrant,
    RecvSpec,
    RemoteEngine,
    SendSpec,
    layout_mismatch,
    prompt_digest,
)
from pdkv.kv_transfer.connector.p2p_push_scheduler import PushScheduler, is_push
from pdkv.kv_transfer.connector.startup import Address
from pdkv.request import RequestStatus

if TYPE_CHECKING:
    from pdkv.cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from pdkv.cache.kv_layout import KVLayout
    from pdkv.kv_transfer.connector.spec import P2PSpec
    from pdkv.request import Request
    from pdkv.sched.output import SchedulerOutput

REQUIRED_PARAMS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_nonce",
    "prompt_digest",
)


class P2PConnectorScheduler:
    """Args:
        spec: the connector (role, engine id; `p2p.kv_lease_duration`).
        layout: this engine's KV layout.
        block_size: tokens per block.
        control_address: (host, port) of this engine's control server (producer), filled in by
            the worker half at start-up and read when building params.
        control_endpoints: (producer at tp > 1) every worker rank's [host, port], rank order,
            filled in by the executor at start-up; empty: [control_address].
        linear_groups: per group, whether it holds linear-attention state slots.
        push_address: push mode, consumer: its data server [host, port] (filled by the worker
            half at start-up), put into grants.

    Raises:
        ValueError: sliding_windows not one per group.
    """

    def __init__(self, spec: P2PSpec, layout: KVLayout, block_size: int,
                 control_address: Address, num_groups: int = 1,
                 sliding_windows: tuple[int | None, ...] = (),
                 control_endpoints: list[Address] | None = None,
                 linear_groups: tuple[bool, ...] = (),
                 push_address: Address | None = None) -> None:
        self.spec = spec
        # Per group: whether it holds linear-attention state slots (one slot moves per request).
        self.linear_groups = tuple(linear_groups) or (False,) * num_groups
        self.control_endpoints = control_endpoints if control_endpoints is not None else []
        self.num_groups = num_groups
        # Per group: the sliding window in tokens, or None (full attention; also when not given).
        self.sliding_windows = tuple(sliding_windows) or (None,) * num_groups
        if len(self.sliding_windows) != num_groups:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {num_groups} groups")
        self.layout = layout
        self.wire_layout = layout.to_wire()  # compared with a producer's (kv_transfer_params)
        self.block_size = block_size
        self.control_address = control_address
        self.lease_s = spec.p2p.kv_lease_duration
        self._to_send: list[SendSpec] = []
        self._to_recv: list[RecvSpec] = []
        self._notify: list[NotifySpec] = []
        self._inflight_recv: set[str] = set()
        self._held: dict[str, int] = {}  # producer: request id -> blocks held
        self._waiting_remote: dict[str, list[NotifySpec]] = {}  # consumer: queued, not yet pulling
        self._last_renew = time.monotonic()
        self.pushes = PushScheduler(spec, layout, block_size, self.sliding_windows,
                                    self.linear_groups, push_address)

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _wants_remote_prefill(request: Request) -> bool:
        p = request.kv_transfer_params
        return bool(p and p.get("do_remote_prefill"))

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Start-up: the block manager (push mode reads a producer request's block table)."""
        self.pushes.bind_kv_cache_manager(kv_cache_manager)

    def validate_request(self, request: Request) -> None:
        p = request.kv_transfer_params
        if not p:
            return
        if is_push(p):
            self.pushes.validate(request, p)
            return
        if p.get("do_remote_prefill"):
            if not self.spec.is_kv_consumer:
                raise ValueError("kv_transfer_params.do_remote_prefill needs a kv_consumer engine")
            missing = [k for k in REQUIRED_PARAMS if p.get(k) is None]
            if missing:
                raise ValueError(f"kv_transfer_params for a remote prefill lack {missing}")
            groups = p.get("remote_block_ids")
            if not isinstance(groups, list) or len(groups) != self.num_groups:
                raise ValueError(
                    f"kv_transfer_params.remote_block_ids must hold one block list per KV cache "
                    f"group ({self.num_groups}), got {groups!r:.80}"
                )
            if int(p.get("num_tokens", request.num_prompt_tokens)) != request.num_prompt_tokens:
                raise ValueError(
                    f"kv_transfer_params cover {p.get('num_tokens')} tokens but the prompt has "
                    f"{request.num_prompt_tokens}"
                )
            error = params_consistency_error(p, request.num_prompt_tokens, self.linear_groups)
            if error:
                raise ValueError(error)
            mismatch = layout_mismatch(self.wire_layout, dict(p.get("layout") or {}))
            if mismatch:
                raise ValueError(mismatch)
            error = shard_error(self.wire_layout, p, self.num_groups)
            if error:
                raise ValueError(error)
            if any(self.linear_groups):
                error = linear_state_error(request, p)
                if error:
                    raise ValueError(error)
        if p.get("do_remote_decode") and not self.spec.is_kv_producer:
            raise ValueError("kv_transfer_params.do_remote_decode needs a kv_producer engine")

    def _remote(self, request: Request) -> tuple[RemoteEngine, str]:
        p = request.kv_transfer_params or {}
        remote = RemoteEngine(
            str(p["remote_engine_id"]), str(p["remote_host"]), int(p["remote_port"])
        )
        return remote, str(p["remote_request_id"])

    @staticmethod
    def _digest_error(request: Request) -> str:
        """Why the params' prompt_digest does not describe this request's prompt, or ""."""
        p = request.kv_transfer_params or {}
        mine = prompt_digest(request.prompt_token_ids, request.cache_salt)
        if str(p.get("prompt_digest")) == mine:
            return ""
        return ("kv_transfer_params.prompt_digest does not match this request's prompt and "
                "cache_salt: the remote KV belongs to another prompt")

    def _remote_ranks(self, request: Request) -> tuple[RemoteEngine, ...]:
        """A producer at tp > 1: each of its ranks' control servers (rank order); else ()."""
        p = request.kv_transfer_params or {}
        if p.get("tp_size", 1) == 1:
            return ()
        engine_id = str(p["remote_engine_id"])
        return tuple(RemoteEngine(engine_id, str(host), int(port)) for host, port in p["endpoints"])

    def _notices(self, request: Request, kind: str) -> list[NotifySpec]:
        """`kind` about the request's grant, to the producer (to each of its ranks at tp > 1)."""
        remote, rid = self._remote(request)
        nonce = str((request.kv_transfer_params or {}).get("remote_nonce", ""))
        return [NotifySpec(r, rid, kind, nonce) for r in self._remote_ranks(request) or (remote,)]

    # ------------------------------------------------------------- lifecycle
    def push_grant(self, request_id: str) -> PushGrant | None:
        """Push mode, consumer: the open window of a request admitted with do_remote_prefill
        and transfer_mode "push", or None (not admitted yet, or landed / failed)."""
        return self.pushes.grant(request_id)

    def push_first_token(self, request_id: str, token: int) -> None:
        """Push mode, consumer, a linear-state model: P's sampled token for the request
        (`PushScheduler.set_first_token`; ValueError when no window waits for one)."""
        self.pushes.set_first_token(request_id, token)

    def on_new_request(self, request: Request) -> None:
        p = request.kv_transfer_params or {}
        if "push_grant" in p:  # producer: validated already
            self.pushes.start_pushing(request)
            return
        if is_push(p):
            return
        if self._wants_remote_prefill(request) and not self._digest_error(request):
            self._waiting_remote[request.request_id] = self._notices(request, "renew")

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._wants_remote_prefill(request):
            return 0, False
        n = request.num_prompt_tokens - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if not self._wants_remote_prefill(request):
            return
        p = request.kv_transfer_params or {}
        if is_push(p):
            self.pushes.open_window(request, blocks, num_external_tokens)
            self._inflight_recv.add(request.request_id)
            p["do_remote_prefill"] = False  # one transfer per request
            return
        remote, remote_rid = self._remote(request)
        self._waiting_remote.pop(request.request_id, None)
        local = blocks.get_block_ids()
        error = self._digest_error(request)
        if num_external_tokens > 0 or error:
            p_bs = int(dict(p.get("layout") or {}).get("block_size", self.block_size))
            reblock: dict[str, int] = {}
            if p_bs != self.layout.block_size:  # (per rank under DCP)
                first, local_ids, remote_ids = self._reblock_map(request, local, p_bs)
                reblock = {"remote_block_size": p_bs, "first_token": request.num_computed_tokens,
                           "end_token": request.num_prompt_tokens}
            else:
                first, local_ids, remote_ids = self._block_map(request, local)
            firsts: tuple[int, ...] = ()
            if any(w is not None for w in self.sliding_windows):
                firsts, local_ids, remote_ids = self._window_only(
                    request, first, local_ids, remote_ids
                )
            if any(self.linear_groups):
                firsts, local_ids, remote_ids = self._last_slot_only(
                    request, firsts or (first,) * len(local_ids), local_ids, remote_ids
                )
            self._to_recv.append(
                RecvSpec(
                    request.request_id,
                    remote,
                    remote_rid,
                    local_ids,
                    remote_ids,
                    dict(p.get("layout") or {}),
                    remote_nonce=str(p.get("remote_nonce", "")),
                    prompt_digest=prompt_digest(request.prompt_token_ids, request.cache_salt),
                    remote_first_block=first,
                    error=error,
                    group_first_blocks=firsts,
                    remote_ranks=self._remote_ranks(request),
                    **reblock,
                )
            )
            self._inflight_recv.add(request.request_id)
        else:  # everything was local: the producer can let go
            self._notify.extend(self._notices(request, "release"))
        p["do_remote_prefill"] = False  # one transfer per request

    def _block_map(self, request: Request, new_blocks: tuple[list[int], ...]
                   ) -> tuple[int, tuple[list[int], ...], tuple[list[int], ...]]:
        """(K0, local ids, remote ids) per group: P's blocks from K0 = num_computed_tokens // P's
        block size on, each paired with the logical block that holds its tokens,
        D_block_table[(K0 + i) // N] (N = this engine's DCP size; the same id repeats N times).
        `new_blocks` are the request's blocks after its num_computed_tokens // block_size
        computed (prefix-hit) ones."""
        p = request.kv_transfer_params or {}
        n = self.layout.dcp
        p_bs = int(dict(p.get("layout") or {}).get("block_size", self.block_size))
        k0 = request.num_computed_tokens // p_bs
        if n == 1:  # one block of P per block of D
            return (
                k0,
                new_blocks,
                tuple(
                    list(g[k0 : k0 + len(lg)]) for g, lg in zip(p["remote_block_ids"], new_blocks)
                ),
            )
        hit = request.num_computed_tokens // self.block_size  # logical blocks not in new_blocks
        local_ids, remote_ids = [], []
        for g, lg in zip(p["remote_block_ids"], new_blocks):
            rg = list(g[k0 : (hit + len(lg)) * n])
            remote_ids.append(rg)
            local_ids.append([lg[(k0 + i) // n - hit] for i in range(len(rg))])
        return k0, tuple(local_ids), tuple(remote_ids)

    def _window_only(self, request: Request, first: int, local_ids: tuple[list[int], ...],
                     remote_ids: tuple[list[int], ...]
                     ) -> tuple[tuple[int, ...], tuple[list[int], ...], tuple[list[int], ...]]:
        """Drop, in sliding-window groups, the block pairs D does not need: D resumes at the
        last prompt token (position n - 1; at n, after P's token, on a model with a state-slot
        group); it keeps the window of the block boundary B at or before that position (tokens
        from B - W + 1: all that the resumed query reads, and what a later request with the
        same prompt needs for a prefix hit of B tokens; see KVCacheManager.cache_loaded_blocks).
        Blocks before
        (B - W + 1) // block_size are neither read from P (which may have freed them: their ids
        are its null block) nor written here (this engine frees them when the request resumes).
        Equal block sizes, no DCP (both refused with a sliding window elsewhere).

        Returns:
            (index of each group's first remaining pair in P's grant, local ids, remote ids).
        """
        firsts, local, remote = [], [], []
        for window, lg, rg in zip(self.sliding_windows, local_ids, remote_ids):
            skip = 0
            if window is not None:
                resume = request.num_prompt_tokens - (0 if any(self.linear_groups) else 1)
                keep = window_first_block(resume, self.block_size, window)
                skip = min(len(lg), max(0, keep - first))
            firsts.append(first + skip)
            local.append(list(lg[skip:]))
            remote.append(list(rg[skip:]))
        return tuple(firsts), tuple(local), tuple(remote)

    def _last_slot_only(self, request: Request, firsts_in: tuple[int, ...],
                        local_ids: tuple[list[int], ...], remote_ids: tuple[list[int], ...]
                        ) -> tuple[tuple[int, ...], tuple[list[int], ...], tuple[list[int], ...]]:
        """A model with a linear-state group (D resumes at n, after P's token): in a linear
        group only the slot holding the state after all n prompt tokens moves: P's grant lists
        just that slot (`request_finished`), D's is the last entry of its table (the request's
        one slot, or with prefix caching the entry of block (n - 1) // block_size, which the
        worker reads as the state of position n). The other groups keep their pairs and their
        first index (`firsts_in`: the window's first block in a sliding-window group).

        Returns:
            (index of each group's first pair in P's grant, local ids, remote ids).
        """
        p = request.kv_transfer_params or {}
        firsts, local, remote = [], [], []
        for linear, lg, rg, granted, first in zip(
            self.linear_groups, local_ids, remote_ids, p["remote_block_ids"], firsts_in
        ):
            firsts.append(0 if linear else first)
            local.append(list(lg[-1:]) if linear else list(lg))
            remote.append(list(granted[-1:]) if linear else list(rg))
        return tuple(firsts), tuple(local), tuple(remote)

    def _reblock_map(self, request: Request, new_blocks: tuple[list[int], ...], p_bs: int
                     ) -> tuple[int, tuple[list[int], ...], tuple[list[int], ...]]:
        """Re-blocking (P's block size `p_bs` differs from this engine's, no DCP): (K0, local ids,
        remote ids) per group for tokens [F, prompt end), F = num_computed_tokens (this engine's
        local hits, a multiple of its block size): P's blocks K0 = F // p_bs .. ceil(end / p_bs)
        and this engine's blocks holding those tokens (`new_blocks` start at block F // block
        size)."""
        p = request.kv_transfer_params or {}
        first, end = request.num_computed_tokens, request.num_prompt_tokens
        k0, k_end = first // p_bs, -(-end // p_bs)
        n_local = -(-end // self.block_size) - first // self.block_size
        return (k0, tuple(list(lg[:n_local]) for lg in new_blocks),
                tuple(list(g[k0:k_end]) for g in p["remote_block_ids"]))

    def build_connector_meta(self, out: SchedulerOutput | None = None) -> P2PConnectorMetadata:
        now = time.monotonic()
        pushes = self.pushes.push_specs(out) if out is not None else []
        windows, closes = self.pushes.take_windows(), self.pushes.take_closes()
        tokens = self.pushes.take_tokens()
        if self._waiting_remote and now - self._last_renew > self.lease_s / 3:
            for notes in self._waiting_remote.values():
                self._notify.extend(notes)
            self._last_renew = now
        meta = P2PConnectorMetadata(reqs_to_send=self._to_send, reqs_to_recv=self._to_recv,
                                    notifications=self._notify, reqs_to_push=pushes,
                                    windows_to_open=windows, windows_to_close=closes,
                                    window_tokens=tokens)
        self._to_send, self._to_recv, self._notify = [], [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._inflight_recv -= output.finished_recving
        for rid in output.finished_recving:
            self.pushes.window_closed(rid)
        for rid in output.finished_sending:
            self._held.pop(rid, None)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, JSONObject | None]:
        rid = request.request_id
        p = request.kv_transfer_params or {}
        pushed = self.pushes.finished(request)
        if pushed is not None:  # P: every push of its steps ended in wait_for_save; hold nothing
            return False, pushed
        if rid in self._inflight_recv:  # aborted during the pull: free after it ends
            self.pushes.abort(rid)  # (a push window: closed now, ends when no write receives)
            return True, None
        if self._wants_remote_prefill(request):  # aborted before pulling: let P go
            if (
                self._waiting_remote.pop(rid, None) is not None
            ):  # (never for another prompt's grant)
                self._notify.extend(self._notices(request, "release"))
            return False, None
        done_ok = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        if not (p.get("do_remote_decode") and self.spec.is_kv_producer and done_ok):
            return False, None
        if not any(block_ids):
            return False, None
        nonce = secrets.token_hex(16)
        digest = prompt_digest(request.prompt_token_ids, request.cache_salt)
        extra: dict[str, Any] = {}
        windows = self.sliding_windows + (None,) * len(block_ids)
        # (a window group's entries before its window are its pool's null block, id 0: not held)
        held = sum(len(g) if w is None else sum(1 for b in g if b != NULL_BLOCK_ID)
                   for w, g in zip(windows, block_ids))
        if any(self.linear_groups):  # one slot per linear group: the state after all n tokens
            block_ids = tuple(
                list(g[-1:]) if linear else g for linear, g in zip(self.linear_groups, block_ids)
            )
            if not request.output_token_ids:
                return False, None
            extra["first_token"] = int(request.output_token_ids[0])
        self._to_send.append(SendSpec(rid, block_ids, self.lease_s, nonce, digest))
        self._held[rid] = held
        host, port = self.control_address
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.spec.engine_id,
            "remote_request_id": rid,
            "remote_block_ids": [list(g) for g in block_ids],
            "remote_host": host,
            "remote_port": port,
            "remote_nonce": nonce,
            "prompt_digest": digest,
            "tp_size": self.layout.tp,
            "dcp_size": self.layout.dcp,
            "endpoints": [list(e) for e in self.control_endpoints] or [[host, port]],  # per rank
            "block_size": self.block_size,
            "num_tokens": request.num_prompt_tokens,
            "layout": self.layout.to_wire(),
            **extra,
        }

    def next_deadline(self) -> float | None:
        """When the next lease renewal for queued remote-prefill requests is due, or None."""
        return self._last_renew + self.lease_s / 3 if self._waiting_remote else None

    def has_pending_metadata(self) -> bool:
        return bool(self._to_send or self._to_recv or self._notify
                    or self.pushes.has_pending_metadata())

    def has_pending_work(self) -> bool:
        return bool(self._to_send or self._to_recv or self._notify or self._inflight_recv
                    or self._held or self._waiting_remote or self.pushes.has_pending_metadata())

    @property
    def num_blocks_held(self) -> int:
        return sum(self._held.values())
