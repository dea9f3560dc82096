"""Push mode of the P2P worker half (`transfer_mode: push`): P writes each layer's KV into the
blocks D granted while it computes the next layers (vLLM's NIXL connector push mode, where P
writes into D's memory; vLLM-Ascend's layer-wise connector and SGLang / Mooncake layer-wise
sends, where D first allocates and tells P where to write).

P side (`PushSender`): the step's `PushSpec`s name, per request, pairs (P block, D block) per KV
cache group. The model forward calls `save_kv_layer(i)` after layer i wrote its KV
(pdkv/model/layer_hooks.py); that layer's bytes of every pair, [block, layer i of its group] of
the group tensor [num_blocks, layers_in_group, ...], are queued for a sender thread that writes
them over the transfer engine (`TransferEngine.write`) while the next layers compute.
`wait_for_save` waits, with a deadline, until the step's writes are done (the blocks may be
reused after it). Across block sizes (`PushSpec.reblock`) the pairs are D's blocks: each layer
of each is gathered from P's blocks into a buffer of D's per-layer unit on the engine thread
(pdkv/kv_transfer/reblock.py, `plan_unit_gather`) and written as one unit; equal block sizes
write straight from P's blocks (no copy).

D side (`PushReceiver`): a window per granted request, keyed by (request id, nonce), opened by the
scheduler half's `WindowSpec`. The data server (tcp; shm and mooncake: the push control server,
before P's one-sided write) asks `authorize` before accepting a write: the
grant must name an open window, and every range must be whole (block, layer) units of the
window's blocks not written before; anything else is refused (no byte written) and counted
(`kv_push_refused`). When every unit of every granted block has landed, the request's load
succeeds (reported like a finished pull: `kv_bytes_received`, finished_recving); a window whose
lease passes first fails the load (kv_load_failure_policy decides). No KV is read before then:
the request waits in WAITING_FOR_REMOTE_KVS.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from pdkv.kv_transfer.connector.p2p_messages import PushSpec, WindowSpec
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.engine.base import Grant, TransferEngine, TransferError, WriteOp
from pdkv.kv_transfer.reblock import plan_unit_gather

if TYPE_CHECKING:
    from pdkv.cache.specs import KVCacheConfig

logger = logging.getLogger(__name__)

WRITE_GRACE_S = 2.0
"""`wait_for_save` waits this long past the step's write deadline: every write is bounded by that
deadline itself, so none still reads P's blocks when the step ends and they may be reused."""

TIMELINE_LEN = 4096
"""Per-layer write records a sender keeps for `take_timeline` (the latest; older ones drop)."""

LayerSlot = tuple[int, int, int]
"""A model layer's place in the KV cache: (group, index within the group, layers in the group)."""


def layer_slots(kv_cache_config: KVCacheConfig) -> list[LayerSlot]:
    """Per model layer (0 .. num_layers - 1), its (group, index in group, layers in group).

    Raises:
        ValueError: a layer in no group or in two.
    """
    slots: dict[int, LayerSlot] = {}
    for g, group in enumerate(kv_cache_config.groups):
        for j, layer in enumerate(group.layer_indices):
            if layer in slots:
                raise ValueError(f"layer {layer} is in two KV cache groups")
            slots[layer] = (g, j, len(group.layer_indices))
    if sorted(slots) != list(range(len(slots))):
        raise ValueError(f"KV cache groups leave layers out: {sorted(slots)}")
    return [slots[i] for i in range(len(slots))]


class PushSender:
    """P's layer-wise sender.

    Args:
        engine: the transfer engine writes go through (tcp; shm and mooncake reserve each
            write with D first: engine/push_control.py).
        results: where counters go (`kv_bytes_pushed`, `kv_push_writes`, `kv_push_failures`).
        regions: this engine's KV cache bytes per group (filled at register_kv_caches).
        block_bytes: bytes per block of each group (filled at register_kv_caches).
        slots: `layer_slots` of this engine.
        timeout: seconds a step's writes may take (transfer_timeout): the deadline of each
            write and of `wait_for_save`.
    """

    def __init__(self, engine: TransferEngine, results: WorkerResults,
                 regions: list[memoryview], block_bytes: list[int], slots: list[LayerSlot],
                 timeout: float) -> None:
        self.engine = engine
        self.results = results
        self.regions = regions
        self.block_bytes = block_bytes
        self.slots = slots
        self.timeout = timeout
        self._specs: list[PushSpec] = []
        self._deadline = 0.0
        self._failed: set[str] = set()  # P request ids whose push failed this step
        self._queue: queue.Queue[tuple[PushSpec, list[WriteOp], float, int, float] | None] = \
            queue.Queue()
        # Per layer write of the steps that pushed, until `take_timeline` (the latest
        # TIMELINE_LEN): (step start, layer, queued = the layer's forward ended, write started,
        # write ended), time.monotonic().
        self._timeline: collections.deque[tuple[float, int, float, float, float]] = \
            collections.deque(maxlen=TIMELINE_LEN)
        self._step_start = 0.0
        self._pending = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def begin(self, specs: list[PushSpec]) -> None:
        """Engine loop, `start_load_kv`: this step's pushes (none: every hook returns at once)."""
        self._specs = [s for s in specs if any(s.local_block_ids)]
        self._step_start = time.monotonic()
        self._deadline = self._step_start + self.timeout
        self._failed = set()
        if self._specs and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pdkv-kv-push", daemon=True)
            self._thread.start()

    def save_kv_layer(self, layer_index: int) -> None:
        """Engine loop, inside the forward, after layer `layer_index` wrote its KV: queue its
        bytes of every pair of this step's pushes (never blocks)."""
        if not self._specs:
            return
        g, j, n = self.slots[layer_index]
        bb = self.block_bytes[g]
        lb = bb // n
        region = self.regions[g]
        for spec in self._specs:
            if spec.request_id in self._failed:
                continue  # (the sender thread sends no more of it either)
            if spec.reblock:
                ops = self._gathered(spec, g, j, n)
            else:
                pairs = zip(spec.local_block_ids[g], spec.remote_block_ids[g])
                ops = [WriteOp(f"g{g}", d * bb + j * lb, lb,
                               region[p * bb + j * lb : p * bb + (j + 1) * lb]) for p, d in pairs]
            if ops:
                with self._cond:
                    self._pending += 1
                self._queue.put((spec, ops, self._deadline, layer_index, time.monotonic()))

    def _gathered(self, spec: PushSpec, g: int, j: int, n: int) -> list[WriteOp]:
        """Across block sizes: layer `j` (of `n` in group `g`) of each of the spec's D blocks,
        gathered from P's blocks into its own buffer of D's per-layer unit (2 × D block size ×
        Σ row bytes; slots past the prompt's end stay zero, D never reads them), one write of a
        whole (block, layer) unit each. Copies on the calling (engine) thread, so P's blocks
        are read before the next layers run. A spec whose rows do not make P's block bytes, or
        whose P blocks do not hold a D block's tokens, fails its push (logged and counted as
        `kv_push_failures`; nothing more of it is sent): D's window then ends at its lease."""
        rb = spec.reblock[g]
        rows = rb.row_bytes
        unit = 2 * rb.d_block_size * sum(rows)
        if not rows or n * 2 * rb.p_block_size * sum(rows) != self.block_bytes[g]:
            self._fail(spec, f"token rows {list(rows)} of {n} layers and block_size "
                             f"{rb.p_block_size} do not make this engine's block bytes "
                             f"{self.block_bytes[g]}")
            return []
        region = self.regions[g]
        ops = []
        for i, d in enumerate(spec.remote_block_ids[g]):
            buf = memoryview(bytearray(unit))
            try:
                copies = plan_unit_gather(spec.local_block_ids[g], rb.p_first_block,
                                          rb.p_block_size, rb.d_block_size, rb.d_first_block + i,
                                          j, n, rows, rb.num_tokens)
            except ValueError as e:
                self._fail(spec, f"re-blocking D block {rb.d_first_block + i}: {e}")
                return []
            for c in copies:
                buf[c.local_offset : c.local_offset + c.nbytes] = \
                    region[c.remote_offset : c.remote_offset + c.nbytes]
            ops.append(WriteOp(f"g{g}", (d * n + j) * unit, unit, buf))
        return ops

    def _fail(self, spec: PushSpec, why: str) -> None:
        logger.warning("push of %s failed: %s", spec.request_id, why)
        if spec.request_id not in self._failed:
            self._failed.add(spec.request_id)
            with self.results.lock:
                self.results.count("kv_push_failures")

    def wait_for_save(self) -> None:
        """Engine loop, after the forward: block until this step's writes are done or its
        deadline (plus WRITE_GRACE_S) passed; then the remaining ones are dropped: D's window
        expires and its request follows kv_load_failure_policy."""
        if not self._specs:
            return
        with self._cond:
            left = self._deadline + WRITE_GRACE_S - time.monotonic()
            done = self._cond.wait_for(lambda: self._pending == 0, timeout=max(0.0, left))
            if not done:
                logger.warning("push: %d writes still unfinished at the step's deadline",
                               self._pending)
                self._failed.update(s.request_id for s in self._specs)
        self._specs = []

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            spec, ops, deadline, layer, queued = item
            try:
                if spec.request_id in self._failed:
                    continue  # one failed layer ruins the window: send no more of it
                g = spec.grant
                started = time.monotonic()
                nbytes = self.engine.write({"host": g.host, "port": g.port}, ops, deadline,
                                           (g.request_id, g.nonce))
                with self._cond:
                    self._timeline.append((self._step_start, layer, queued, started,
                                           time.monotonic()))
                with self.results.lock:
                    self.results.count("kv_bytes_pushed", nbytes)
                    self.results.count("kv_push_writes", len(ops))
            except TransferError as e:
                logger.warning("push of %s failed: %s", spec.request_id, e)
                self._failed.add(spec.request_id)
                with self.results.lock:
                    self.results.count("kv_push_failures")
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def take_timeline(self) -> list[tuple[float, int, float, float, float]]:
        """The per-layer writes since the last call: (step start, layer, the layer's forward end
        (its KV queued), write start, write end), time.monotonic() seconds; a benchmark's
        compute-vs-wire timeline (`pdkv bench handoff --transfer-modes`)."""
        with self._cond:
            out = list(self._timeline)
            self._timeline.clear()
        return out

    def shutdown(self) -> None:
        self._queue.put(None)


class _Window:
    def __init__(self, spec: WindowSpec, deadline: float) -> None:
        self.spec = spec
        self.deadline = deadline
        self.opened = time.monotonic()
        self.blocks = [set(g) for g in spec.block_ids]
        self.landed: set[tuple[int, int, int]] = set()  # (group, block, layer in group)
        self.writes = 0
        self.nbytes = 0
        self.inflight = 0  # accepted writes still receiving (the blocks stay the window's)
        self.closing = False  # the request was aborted: no new write; freed once none receives
        self.token_ok = not spec.needs_token  # a linear-state model: P's first token arrived


class PushReceiver:
    """D's write windows.

    Args:
        results: where landed windows (finished loads), failures and refusals are reported.
        block_bytes: bytes per block of each group (filled at register_kv_caches).
        layers_per_group: KV cache layers of each group.
    """

    def __init__(self, results: WorkerResults, block_bytes: list[int],
                 layers_per_group: list[int]) -> None:
        self.results = results
        self.block_bytes = block_bytes
        self.layers = layers_per_group
        self._lock = threading.Lock()
        self._windows: dict[Grant, _Window] = {}

    def open(self, specs: list[WindowSpec]) -> None:
        """Engine loop: open these windows (a window with no block is done at once)."""
        now = time.monotonic()
        for spec in specs:
            window = _Window(spec, now + spec.lease_s)
            if not any(spec.block_ids):
                self.results.load_empty(spec.request_id)
                continue
            with self._lock:
                self._windows[(spec.request_id, spec.nonce)] = window

    def _refuse(self, why: str) -> str:
        with self.results.lock:
            self.results.count("kv_push_refused")
        self.results.wake()  # an idle engine publishes the count now
        logger.warning("push write refused: %s", why)
        return why

    def authorize(self, grant: Grant | None, region: str,
                  ranges: list[tuple[int, int]]) -> str | None:
        """Data-server threads: None to accept writing `ranges` ((offset, length) of `region`,
        "g<group>") under `grant`, else why not (counted as `kv_push_refused`)."""
        if grant is None:
            return self._refuse("write names no grant")
        try:
            g = int(region[1:])
            bb = self.block_bytes[g]
        except (ValueError, IndexError):
            return self._refuse(f"unknown region {region!r}")
        lb = bb // self.layers[g]
        with self._lock:
            window = self._windows.get(grant)
            if window is None or window.closing:
                return self._refuse(f"no open push window for request {grant[0]!r} with that "
                                    "nonce (unknown, stale, finished, aborted or expired)")
            for off, n in ranges:
                block, within = divmod(off, bb)
                if n <= 0 or within % lb or n % lb or within + n > bb:
                    return self._refuse(f"range {off}+{n} of {region!r} is not whole layers of "
                                        "one block")
                if block not in window.blocks[g]:
                    return self._refuse(f"range {off}+{n} of {region!r} is outside the window "
                                        f"of {grant[0]!r}")
                for j in range(within // lb, (within + n) // lb):
                    if (g, block, j) in window.landed:
                        return self._refuse(f"block {block} layer {j} of {region!r} was "
                                            f"already written for {grant[0]!r}")
            window.inflight += 1
        return None

    def on_written(self, grant: Grant, region: str, ranges: list[tuple[int, int]],
                   landed: bool) -> None:
        """Data-server threads: an authorized write ended (`landed`: all its bytes arrived;
        else its units stay unwritten). The window's load succeeds once every (block, layer)
        unit of every group has landed and no accepted write is still receiving."""
        g = int(region[1:])
        bb = self.block_bytes[g]
        lb = bb // self.layers[g]
        with self._lock:
            window = self._windows.get(grant)
            if window is None:
                return
            window.inflight -= 1
            if window.closing:
                if not window.inflight:
                    del self._windows[grant]
                    self.results.load_abandoned(window.spec.request_id)
                return
            if not landed:
                return
            for off, n in ranges:
                block, within = divmod(off, bb)
                units = {(g, block, j) for j in range(within // lb, (within + n) // lb)}
                window.nbytes += len(units - window.landed) * lb  # (a racing duplicate: once)
                window.landed |= units
            window.writes += 1
            if not self._complete(grant, window):
                return
        self._succeeded(window)

    def _complete(self, grant: Grant, window: _Window) -> bool:
        """Under the lock: whether every unit of the window landed, no accepted write still
        receives and its first token (if it needs one) arrived; if so it leaves the windows."""
        need = sum(len(b) * self.layers[k] for k, b in enumerate(window.blocks))
        if len(window.landed) < need or window.inflight or not window.token_ok:
            return False
        del self._windows[grant]
        return True

    def _succeeded(self, window: _Window) -> None:
        self.results.load_succeeded(window.spec.request_id, window.nbytes,
                                    time.monotonic() - window.opened, window.writes)

    def _windows_of(self, request_ids: list[str]) -> list[tuple[Grant, _Window]]:
        """Under the lock: the open windows of these requests (any nonce)."""
        ids = set(request_ids)
        return [(k, w) for k, w in self._windows.items() if k[0] in ids] if ids else []

    def tokens(self, request_ids: list[str]) -> None:
        """Engine loop: P's first token arrived for these requests' windows (a linear-state
        model); a window whose layers had all landed completes now."""
        done = []
        with self._lock:
            for key, window in self._windows_of(request_ids):
                if not window.closing:
                    window.token_ok = True
                    if self._complete(key, window):
                        done.append(window)
        for window in done:
            self._succeeded(window)

    def close(self, request_ids: list[str]) -> None:
        """Engine loop: the requests were aborted while their windows were open. Each window
        refuses new writes at once and its load ends (`load_abandoned`: its blocks may be freed)
        now, or when the last accepted write still receiving ends, so that no byte lands in a
        block after it was freed."""
        ended = []
        with self._lock:
            for key, window in self._windows_of(request_ids):
                window.closing = True
                if not window.inflight:
                    del self._windows[key]
                    ended.append(window.spec.request_id)
        for rid in ended:
            self.results.load_abandoned(rid)

    def expire(self) -> None:
        """Engine loop: fail the loads of windows whose lease passed (their blocks hold
        undefined data: the load error names them). A window with an accepted write still
        receiving is failed only when that write ended (the data server's idle timeout bounds
        it), so its blocks are never freed for reuse while bytes still arrive."""
        now = time.monotonic()
        with self._lock:
            late = [k for k, w in self._windows.items()
                    if now > w.deadline and not w.inflight and not w.closing]
            windows = [self._windows.pop(k) for k in late]
        for w in windows:
            with self.results.lock:
                self.results.count("kv_push_window_expirations")
            self.results.load_failed(w.spec.request_id,
                                     "push window deadline passed before every layer landed",
                                     w.spec.block_ids)

    def next_deadline(self) -> float | None:
        """Earliest window deadline (time.monotonic()), or None."""
        with self._lock:
            return min((w.deadline for w in self._windows.values()), default=None)
