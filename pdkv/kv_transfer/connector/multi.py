"""MultiConnector (vLLM's name): several connectors under one engine, e.g. P/D plus a KV pool.

`{"kv_connector": "MultiConnector", "kv_role": ..., "kv_connector_extra_config": {"connectors":
[{"kv_connector": "P2PConnector", ...}, {"kv_connector": "KVPoolConnector", ...}]}}`; a child's
kv_role defaults to the parent's, its engine_id is the parent's.

Semantics (vLLM's, plus one deliberate extension):
- Saves go to every child; `request_finished` asks every child and the first kv_transfer_params
  returned win; the free is delayed until every child that asked for a delay reported the
  request in finished_sending (counted per child: the first child's report never frees blocks
  another child still reads).
- Loads: vLLM lets the first child that reports matched tokens load them. pdkv **chains** loads:
  child 0 is asked after the local prefix hits, child 1 after child 0's tokens, and so on; the
  scheduler sees one asynchronous load of the sum, and the request is reported in
  finished_recving only when every child that loads a part is done. D = [pool consumer, P2P
  consumer] therefore loads what the pool has and pulls only the rest from P. A later child's
  part that would cover only the last prompt token is dropped (that token is recomputed anyway),
  so a prompt the pool holds whole pulls nothing from P (P is told to release).
- A synchronous answer (load_async=False) is taken only from the first child that answers, and
  ends the chain.
- Load failures: each child's kv_load_failure_policy (unset: its connector's default) applies
  to its own part; when several parts fail, "fail" wins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from pdkv.cache.kv_cache_manager import KVCacheBlocks
from pdkv.cache.kv_layout import KVLayout
from pdkv.jsontypes import JSONObject
from pdkv.kv_transfer.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from pdkv.kv_transfer.connector.spec import ConnectorSpec, MultiSpec
from pdkv.kv_transfer.connector.startup import ConnectorStartup

if TYPE_CHECKING:
    import torch

    from pdkv.cache.kv_cache_manager import KVCacheManager
    from pdkv.cache.specs import KVCacheConfig
    from pdkv.kvpool.events import PoolEventQueue
    from pdkv.request import Request
    from pdkv.sched.output import SchedulerOutput


class MultiConnectorMetadata(KVConnectorMetadata, kw_only=True):
    """Each child's metadata, plus which children a request's load / delayed free waits for.

    Attributes:
        children: one metadata per child, in child order.
        expect_recv: request id -> children loading a part of it (announced with the loads).
        expect_send: request id -> children that delayed its free (announced the step after
            request_finished, with the children's own send registrations).
    """

    children: list[KVConnectorMetadata] = msgspec.field(default_factory=list)
    expect_recv: dict[str, list[int]] = msgspec.field(default_factory=dict)
    expect_send: dict[str, list[int]] = msgspec.field(default_factory=dict)


class _MultiWire(msgspec.Struct, kw_only=True):
    """MultiConnectorMetadata as a worker process receives it: the children still untyped."""

    children: list[Any] = msgspec.field(default_factory=list)
    expect_recv: dict[str, list[int]] = msgspec.field(default_factory=dict)
    expect_send: dict[str, list[int]] = msgspec.field(default_factory=dict)


ChildFactory = Callable[[ConnectorSpec, KVConnectorRole, "KVCacheConfig", KVLayout,
                         ConnectorStartup],
                        KVConnectorBase]
"""(spec, role, kv_cache_config, layout, startup) -> one child connector."""


class MultiConnector(KVConnectorBase):
    """Both halves: fans calls out to the children and aggregates their answers (see module doc).

    Args:
        create_child: builds one child from its spec (pdkv.kv_transfer.connector.factory's
            `create_connector`, which passes itself: the registry imports its products, never
            the other way round).

    Raises:
        ValueError: a child that cannot be built (the children's settings were checked when
            `spec` was parsed, `connector_spec`).
    """

    def __init__(
        self,
        spec: MultiSpec,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        layout: KVLayout,
        startup: ConnectorStartup,
        create_child: ChildFactory,
    ) -> None:
        super().__init__(spec, role, kv_cache_config, layout)
        self.child_specs = spec.children
        self.children = [create_child(c, role, kv_cache_config, layout, startup)
                         for c in self.child_specs]
        self.block_size = kv_cache_config.groups[0].spec.block_size
        # scheduler half
        self._plans: dict[str, list[tuple[int, int, int]]] = {}  # rid -> (child, start, tokens)
        self._loading: dict[str, list[int]] = {}
        self._expect_recv: dict[str, list[int]] = {}
        self._expect_send: dict[str, list[int]] = {}
        # worker half
        self._pending_recv: dict[str, set[int]] = {}
        self._pending_send: dict[str, set[int]] = {}
        self._early_send: dict[str, set[int]] = {}
        self._failed_by: dict[str, set[int]] = {}
        self._ready_send: set[str] = set()

    # ================================================================ scheduler
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        for c in self.children:
            c.bind_kv_cache_manager(kv_cache_manager)

    def validate_request(self, request: Request) -> None:
        for c in self.children:
            c.validate_request(request)

    def on_new_request(self, request: Request) -> None:
        for c in self.children:
            c.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        computed, plan = num_computed_tokens, list[tuple[int, int, int]]()
        for i, child in enumerate(self.children):
            n, load_async = child.get_num_new_matched_tokens(request, computed)
            if n is None:
                return None, False
            if n <= 0:
                continue
            if not load_async:
                if plan:
                    break  # a synchronous part never follows an asynchronous one
                self._plans[request.request_id] = [(i, computed, n)]
                return n, False
            if plan and computed >= request.num_tokens - 1:
                continue  # only the last token would be loaded: it is recomputed anyway
            plan.append((i, computed, n))
            computed += n
        self._plans[request.request_id] = plan
        total = computed - num_computed_tokens
        return (total, True) if total > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        plan = self._plans.pop(rid, [])
        if num_external_tokens <= 0:
            plan = []
        local_hits = request.num_computed_tokens
        parts = {i: (start, n) for i, start, n in plan}
        loading = []
        for i, child in enumerate(self.children):
            if i not in parts:
                child.update_state_after_alloc(request,
                                               KVCacheBlocks(tuple([] for _ in blocks.blocks)), 0)
                continue
            start, n = parts[i]
            lo = (start - local_hits) // self.block_size
            hi = -(-(start + n - local_hits) // self.block_size)
            request.num_computed_tokens = start  # a child's part starts after the earlier ones
            try:
                child.update_state_after_alloc(
                    request, KVCacheBlocks(tuple(list(g[lo:hi]) for g in blocks.blocks)), n)
            finally:
                request.num_computed_tokens = local_hits
            loading.append(i)
        if loading:
            self._loading[rid] = loading
            self._expect_recv[rid] = loading

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MultiConnectorMetadata(
            children=[c.build_connector_meta(scheduler_output) for c in self.children],
            expect_recv=self._expect_recv, expect_send=self._expect_send)
        self._expect_recv, self._expect_send = {}, {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            self._loading.pop(rid, None)
        for c in self.children:
            c.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, JSONObject | None]:
        rid = request.request_id
        self._plans.pop(rid, None)
        delaying, params = [], None
        for i, c in enumerate(self.children):
            delay, p = c.request_finished(request, block_ids)
            if delay:
                delaying.append(i)
            if params is None and p is not None:
                params = p
        if rid in self._loading:
            # Aborted during a load: the free waits for the (aggregated) finished_recving.
            return True, params
        if delaying:
            self._expect_send[rid] = delaying
        return bool(delaying), params

    def take_scheduler_stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.children:
            for k, v in c.take_scheduler_stats().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def has_pending_work(self) -> bool:
        return any(c.has_pending_work() for c in self.children)

    def has_pending_metadata(self) -> bool:
        return bool(self._expect_send) or any(c.has_pending_metadata() for c in self.children)

    def next_deadline(self) -> float | None:
        times = [t for t in (c.next_deadline() for c in self.children) if t is not None]
        return min(times) if times else None

    # =================================================================== worker
    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        for c in self.children:
            c.set_wakeup(wakeup)

    def report_tier_events(self, queue: PoolEventQueue) -> None:
        for c in self.children:
            c.report_tier_events(queue)

    def kv_cache_buffer(self, group: int, nbytes: int) -> memoryview | None:
        for c in self.children:
            buf = c.kv_cache_buffer(group, nbytes)
            if buf is not None:
                return buf
        return None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        for c in self.children:
            c.register_kv_caches(kv_caches)

    def metadata_from_wire(self, raw: object) -> MultiConnectorMetadata:
        """Each child rebuilds its own part (their types differ)."""
        wire = msgspec.convert(raw, _MultiWire)
        if len(wire.children) != len(self.children):
            raise ValueError(f"MultiConnector metadata has {len(wire.children)} children, "
                             f"this connector {len(self.children)}")
        return MultiConnectorMetadata(
            children=[c.metadata_from_wire(m) for c, m in zip(self.children, wire.children)],
            expect_recv=wire.expect_recv, expect_send=wire.expect_send)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        assert isinstance(metadata, MultiConnectorMetadata)
        for rid, kids in metadata.expect_recv.items():
            self._pending_recv.setdefault(rid, set()).update(kids)
        for rid, kids in metadata.expect_send.items():
            pending = set(kids) - self._early_send.pop(rid, set())
            if pending:
                self._pending_send[rid] = pending
            else:
                self._ready_send.add(rid)
        for c, m in zip(self.children, metadata.children):
            c.bind_connector_metadata(m)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for c in self.children:
            c.clear_connector_metadata()

    def start_load_kv(self) -> None:
        for c in self.children:
            c.start_load_kv()

    def wait_for_layer_load(self, layer_index: int) -> None:
        for c in self.children:
            c.wait_for_layer_load(layer_index)

    def save_kv_layer(self, layer_index: int) -> None:
        for c in self.children:
            c.save_kv_layer(layer_index)

    def wait_for_save(self) -> None:
        for c in self.children:
            c.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving = set(self._ready_send), set()
        self._ready_send = set()
        for i, c in enumerate(self.children):
            s, r = c.get_finished(finished_req_ids)
            for rid in s:
                pending = self._pending_send.get(rid)
                if pending is None:  # reported before its expectation arrived
                    self._early_send.setdefault(rid, set()).add(i)
                    continue
                pending.discard(i)
                if not pending:
                    del self._pending_send[rid]
                    sending.add(rid)
            for rid in r:
                pending = self._pending_recv.get(rid)
                if pending is None:
                    recving.add(rid)
                    continue
                pending.discard(i)
                if not pending:
                    del self._pending_recv[rid]
                    recving.add(rid)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        bad: set[tuple[int, int]] = set()
        for c in self.children:
            bad |= c.get_block_ids_with_load_errors()
        return bad

    def get_load_errors(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        for i, c in enumerate(self.children):
            for rid, msg in c.get_load_errors().items():
                self._failed_by.setdefault(rid, set()).add(i)
                name = self.child_specs[i].kv_connector
                errors[rid] = f"{errors[rid]}; {name}: {msg}" if rid in errors else f"{name}: {msg}"
        return errors

    def get_request_bytes(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for c in self.children:
            for rid, paths in c.get_request_bytes().items():
                mine = out.setdefault(rid, {})
                for path, n in paths.items():
                    mine[path] = mine.get(path, 0.0) + n
        return out

    def get_load_failure_policies(self) -> dict[str, str]:
        policies = {}
        for rid, kids in self._failed_by.items():
            chosen = {self.child_specs[i].load_failure_policy for i in kids}
            policies[rid] = "fail" if "fail" in chosen else "recompute"
        self._failed_by = {}
        return policies

    def get_stats(self) -> tuple[dict[str, float], list[float]]:
        stats: dict[str, float] = {}
        times: list[float] = []
        for c in self.children:
            s, t = c.get_stats()
            for k, v in s.items():
                stats[k] = stats.get(k, 0.0) + v
            times.extend(t)
        return stats, times

    def get_observations(self) -> dict[str, list[float]]:
        obs: dict[str, list[float]] = {}
        for c in self.children:
            for k, v in c.get_observations().items():
                obs.setdefault(k, []).extend(v)
        return obs

    def shutdown(self) -> None:
        for c in self.children:
            c.shutdown()
