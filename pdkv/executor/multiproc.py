"""MultiprocExecutor: one worker process per rank, driven by the engine process.

The scheduler stays in the engine process. Each step its output goes to every rank (msgpack over
a pipe per rank); all ranks run the forward pass together (their collectives meet in
torch.distributed) and sample the same tokens from the same logits, so every rank's request state
stays in step without a broadcast; rank 0's output is returned. Every wait has a deadline
(`ParallelConfig.worker_timeout_s`) and watches every worker's process sentinel, so a dead worker
ends the step with an error naming the rank and its exit code instead of a hang (vLLM's
MultiprocExecutor plays the same role; its message queue is shared memory, ours a pipe). Between
steps, the ranks' KV connector worker halves wake the engine loop over a second, one-way pipe per
rank (pdkv.executor.wakeup), and report their next deadline with each step's result.

Across hosts (`--nnodes` > 1, pdkv.executor.nodes) this process is the leader: it spawns the
ranks of node 0 as above and accepts the other nodes' ranks over TCP (pdkv.executor.channel:
the same messages, length-prefixed); every channel is a `RankChannel`, so the code below serves
both. A remote rank has no process sentinel: its step channel turning readable at EOF or with a
broken link (TCP keepalive / user timeout: a cut link shows within about DEAD_PEER_S) ends the
wait the same way, with WorkerDiedError naming the rank and its node.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import msgspec

from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import KVCacheConfig
from pdkv.config import EngineConfig
from pdkv.executor.aggregate import KVOutputAggregator
from pdkv.executor.channel import ChannelListener, RankChannel
from pdkv.executor.messages import (
    ExecuteModel,
    FromWorker,
    InitKVCache,
    KVBlocks,
    ReadKVBlocks,
    Shutdown,
    StepResult,
    ToWorker,
    WorkerFailed,
    WorkerInit,
    WorkerLoaded,
    WorkerReady,
)
from pdkv.executor.nodes import NodeLayout, RemoteRank, accept_remote_ranks
from pdkv.executor.wakeup import WakeupListener
from pdkv.executor.worker_proc import run_worker
from pdkv.kv_transfer.connector.startup import ConnectorStartup
from pdkv.model.llama import LlamaArchConfig
from pdkv.ports import free_port
from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput
from pdkv.worker.kv_cache import KVCacheSizing, make_kv_cache_config, scheduler_view
from pdkv.worker.model_runner import ModelRunner, StepTimings

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

KILLED_PEER_GRACE_S = 2.0
"""How long a rank's failure waits for another rank's exit to show (see `_killed_peer`)."""


class WorkerDiedError(RuntimeError):
    """A worker process exited or failed; the engine cannot continue."""


class MultiprocExecutor:
    """Runs the model on `parallel_config.world_size` worker processes: the `Executor` of a
    TP/DCP engine (pdkv.executor.base).

    Start-up: every rank loads its weight shard; this executor sizes the KV cache once
    (`make_kv_cache_config`: before any process starts when the configuration fixes the size, else
    from the smallest budget the ranks measured) and sends the result to every rank.
    `kv_cache_config` is the scheduler's logical view (blocks of block_size × DCP tokens);
    the KV connector's worker halves live in the workers: they wake the engine loop through
    `set_wakeup` (a listener thread reading every rank's wakeup pipe) and their deadlines are
    `next_deadline`; `connector_startup` holds the P2P producer's rank 0 "control_address" and
    every rank's "control_endpoints", and every rank's KV pool lookup server
    ("pool_lookup_endpoints").

    Args:
        config: the engine's configuration.
        sizing: what sizing the KV cache takes (read from `config` by the engine; its layout
            has world size > 1).
        num_threads: torch CPU threads in all; each worker gets an equal share (at least 1).

    Raises:
        WorkerDiedError: a worker failed or exited during start-up (its traceback in the message).
        TimeoutError: a worker did not report within worker_timeout_s.
        ValueError: the model's heads do not fit the layout (named), or the KV cache cannot hold
            one request of max_model_len tokens.
    """

    model_runner: ModelRunner | None = None  # the runners live in the worker processes

    def __init__(self, config: EngineConfig, sizing: KVCacheSizing, num_threads: int) -> None:
        par = config.parallel_config
        self.layout_ = sizing.layout
        arch = LlamaArchConfig.from_hf_folder(config.model_config.path)
        self.layout_.check_heads(arch.num_heads, arch.num_kv_heads)
        per_rank: KVCacheConfig | None = None
        if config.cache_config.gpu_memory_utilization is None or config.cache_config.num_kv_blocks:
            # The size does not depend on memory: a pool too small for one request is refused
            # here, before any process starts (ValueError naming the values).
            per_rank = make_kv_cache_config(arch, sizing)
        self.world_size = self.layout_.world_size
        self.timeout_s = par.worker_timeout_s
        self.connector_startup = ConnectorStartup()
        self.timings = StepTimings()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self._closed = False
        # Ranks that report KV connector output (with PCP only rank 0: one replica publishes).
        self._kv_outputs = KVOutputAggregator(self.layout_.kv_publishers)
        ctx = mp.get_context("spawn")
        nodes = NodeLayout.of(par)
        self.nodes = nodes
        if nodes.nnodes > 1:
            init_method, node_host = nodes.init_method, nodes.master_addr
        else:
            port = par.distributed_init_port or free_port()
            init_method, node_host = f"tcp://127.0.0.1:{port}", ""
        local = nodes.ranks(0)
        threads = max(1, num_threads // len(local))
        self._conns: list[RankChannel] = []
        self._procs: list[BaseProcess | None] = []  # None: a rank on another node
        self._remote: dict[int, RemoteRank] = {}
        self._deadlines: list[float | None] = []  # per rank, reported with the last step
        wake_reads: list[RankChannel] = []
        self._listener: WakeupListener | None = None
        control: ChannelListener | None = None

        def init_msg(rank: int, host: str) -> WorkerInit:
            return WorkerInit(
                rank=rank, model_config=config.model_config, cache_config=config.cache_config,
                parallel_config=par, kv_transfer_config=config.kv_transfer_config,
                init_method=init_method, num_threads=threads, node_host=host)

        try:
            if nodes.nnodes > 1:  # listen before any rank starts: remote ranks retry until then
                control = ChannelListener(*nodes.control_address)
            for rank in local:
                parent, child = ctx.Pipe(duplex=True)
                wake_read, wake_write = ctx.Pipe(duplex=False)
                wake_reads.append(wake_read)
                proc = ctx.Process(target=run_worker, args=(child, wake_write),
                                   name=f"pdkv-worker-{rank}", daemon=True)
                proc.start()
                child.close()
                wake_write.close()  # the worker holds the only write end: EOF when it exits
                self._conns.append(parent)
                self._procs.append(proc)
                self._send(rank, init_msg(rank, node_host))
            if control is not None:
                logger.info("waiting for ranks %d-%d of nodes 1-%d at %s:%d", len(local),
                            self.world_size - 1, nodes.nnodes - 1, *nodes.control_address)
                self._remote = accept_remote_ranks(
                    control, nodes, time.monotonic() + self.timeout_s, self.timeout_s,
                    self._check_local_ranks)
                for rank in range(len(local), self.world_size):
                    remote = self._remote[rank]
                    assert remote.step is not None and remote.wakeup is not None
                    self._conns.append(remote.step)
                    self._procs.append(None)
                    wake_reads.append(remote.wakeup)
                    self._send(rank, init_msg(rank, remote.host))
            self._listener = WakeupListener(wake_reads)
            loaded = [self._recv(rank, time.monotonic() + self.timeout_s, "start-up")
                      for rank in range(self.world_size)]
            if per_rank is None:  # the smallest budget, so that every rank's pool fits
                budgets = [m.kv_budget_bytes for m in loaded if isinstance(m, WorkerLoaded)]
                per_rank = make_kv_cache_config(arch, sizing,
                                                min(b for b in budgets if b is not None))
            init_kv = InitKVCache.from_config(per_rank)
            for rank in range(self.world_size):
                self._send(rank, init_kv)
            readies = [self._recv(rank, time.monotonic() + self.timeout_s, "start-up")
                       for rank in range(self.world_size)]
        except BaseException:
            if self._listener is None:
                for conn in wake_reads:
                    conn.close()
            self.shutdown()
            raise
        finally:
            if control is not None:
                control.close()
        ready = [r for r in readies if isinstance(r, WorkerReady)]
        head = ready[0]
        self.num_blocks = per_rank.num_blocks
        self.kv_cache_bytes_per_rank = per_rank.total_bytes
        self.kv_layout = KVLayout.from_wire(head.layout)
        self.vocab_size = head.vocab_size
        self.eos_token_id: int | None = head.eos_token_id
        publishing = [r for r in ready if self.layout_.publishes_kv(r.rank)]  # PCP: rank 0
        for r in ready:
            if not self.layout_.publishes_kv(r.rank) and (r.control_address
                                                          or r.pool_lookup_address):
                self.shutdown()
                raise RuntimeError(f"PCP rank {r.rank} started a KV connector server: only PCP "
                                   "rank 0 publishes the replica")
        addresses = [list(r.control_address) for r in publishing]
        if all(len(a) == 2 and a[1] for a in addresses):  # P2P producer: a control server per rank
            self.connector_startup = ConnectorStartup(control_address=addresses[0],
                                                      control_endpoints=addresses)
        lookups = [list(r.pool_lookup_address) for r in publishing]
        if all(len(a) == 2 and a[1] for a in lookups):  # KV pool: a lookup server per rank
            self.connector_startup.pool_lookup_endpoints = lookups
        self.kv_cache_config: KVCacheConfig = scheduler_view(per_rank, self.layout_.dcp_size)
        lay = self.layout_
        logger.info("%d worker processes (tp %d, dcp %d, pcp %d, %s): pids %s", self.world_size,
                    lay.tp_size, lay.dcp_size, lay.pcp_size,
                    "replicated weights" if lay.dcp_replicated
                    else "full KV replicas" if lay.pcp_size > 1 else "vLLM mode", self.pids)
        if self._remote:
            logger.info("ranks on other nodes: %s",
                        ", ".join(f"{r} at {m.host}" for r, m in sorted(self._remote.items())))

    @property
    def pids(self) -> list[int | None]:
        """Worker process ids, by rank (None: a rank on another node)."""
        return [p.pid if p is not None else None for p in self._procs]

    def _check_local_ranks(self) -> None:
        """Raises WorkerDiedError when a rank of this node has exited (or reported a failure)."""
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True)):
            if proc is not None and (not proc.is_alive() or conn.poll()):
                self._recv(rank, time.monotonic() + self.timeout_s, "start-up")
                raise self._died(rank, "answered before the other nodes joined")

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """The engine loop's wakeup: the listener thread calls it when a rank's connector worker
        half has news for the next step, or a rank's process exited (the step reports it)."""
        if self._listener is not None:
            self._listener.set_wakeup(wakeup)

    def next_deadline(self) -> float | None:
        """The earliest `next_deadline()` of the ranks' connector worker halves, as each reported
        it with the last step, or None. Only a step moves one earlier; between steps one can
        only move later (a pull's read began), and a stale one costs a spare step."""
        return min((t for t in self._deadlines if t is not None), default=None)

    def dead_workers(self) -> list[int]:
        """Ranks whose process has exited, or (a rank on another node) whose step channel
        broke: EOF, reset, or its link silent past the dead-peer time (a cheap check any
        thread may make: /health)."""
        dead = []
        for rank, p in enumerate(self._procs):
            if p is not None:
                if not p.is_alive():
                    dead.append(rank)
            elif self._remote_gone(rank) is not None:
                dead.append(rank)
        return dead

    def _remote_gone(self, rank: int) -> str | None:
        remote = self._remote.get(rank)
        if remote is None or remote.step is None:
            return "not connected"
        return remote.step.gone()

    def _send(self, rank: int, msg: ToWorker) -> None:
        try:
            self._conns[rank].send_bytes(self._encoder.encode(msg))
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            what = "pipe closed" if self._procs[rank] is not None else "connection broken"
            raise self._died(rank, f"{what} ({e})") from None

    def _killed_peer(self, rank: int, grace_s: float) -> int | None:
        """Another rank that a signal ended (SIGKILL, the OOM killer), waiting up to `grace_s`
        for its exit to show; None if none. When one rank is killed, its peers fail in their next
        collective (gloo: "Connection reset by peer") as soon as its sockets close, which can be
        before its process has exited: the killed rank, not the first to report, is the cause."""
        others = {p.sentinel: r for r, p in enumerate(self._procs) if r != rank and p is not None}
        deadline = time.monotonic() + grace_s
        while others:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for s in wait(list(others), timeout=left):
                peer = others.pop(s) if isinstance(s, int) else None
                if peer is None:
                    continue
                proc = self._procs[peer]
                assert proc is not None
                proc.join(1.0)
                code = proc.exitcode
                if code is not None and code < 0:
                    return peer
        return None

    def _died(self, rank: int, what: str) -> WorkerDiedError:
        proc = self._procs[rank] if rank < len(self._procs) else None
        if proc is None:
            remote = self._remote.get(rank)
            where = f"on node {self.nodes.node_of(rank)}" + (f" at {remote.host}" if remote else "")
            return WorkerDiedError(f"worker rank {rank} ({where}) {what}")
        return WorkerDiedError(
            f"worker rank {rank} (pid {proc.pid}) {what}; exit code {proc.exitcode}"
        )

    def _join(self, rank: int, timeout: float) -> None:
        proc = self._procs[rank]
        if proc is not None:
            proc.join(timeout)

    def _recv(self, rank: int, deadline: float,
              what: str) -> WorkerLoaded | WorkerReady | StepResult | KVBlocks:
        """The next message of `rank`, watching every worker's sentinel until `deadline`."""
        conn = self._conns[rank]
        # What ends the wait early: a local rank's process sentinel, a remote rank's channel
        # (readable at EOF or a broken link; one that turns readable with a message is only
        # dropped from the watch: it is read in its turn).
        watch: dict[object, int] = {p.sentinel: r for r, p in enumerate(self._procs)
                                    if p is not None}
        for r in self._remote:
            if r != rank:
                watch[self._conns[r]] = r
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"worker rank {rank} sent nothing within {self.timeout_s:.0f} s ({what})"
                )
            ready = wait([conn, *watch], timeout=left)  # type: ignore[list-item]
            if conn in ready:
                try:
                    msg = self._decoder.decode(conn.recv_bytes())
                except EOFError as e:
                    self._join(rank, 1.0)
                    how = "closed its pipe" if self._procs[rank] is not None else f"was lost ({e})"
                    raise self._died(rank, f"{how} during {what}") from None
                except TimeoutError as e:
                    raise self._died(rank, f"stalled mid-message during {what} ({e})") from None
                if isinstance(msg, WorkerFailed):
                    self._join(rank, 5.0)
                    killed = self._killed_peer(rank, KILLED_PEER_GRACE_S)
                    if killed is not None:  # the cause; `rank` failed in a collective with it
                        first = msg.error.strip().splitlines()[-1] if msg.error.strip() else ""
                        raise self._died(killed, f"was killed during {what} (rank {rank} then "
                                                 f"failed: {first})")
                    raise WorkerDiedError(f"worker rank {rank} failed during {what}:\n{msg.error}")
                return msg
            for s in ready:
                if s not in watch:
                    continue
                other = watch[s]
                if self._procs[other] is None:  # a remote rank's channel
                    gone = self._remote_gone(other)
                    if gone is None:
                        del watch[s]  # a message waits there: read in its turn
                        continue
                    raise self._died(other, f"was lost during {what} ({gone})")
                if other == rank and conn.poll():
                    break  # its last words (WorkerFailed) are in the pipe: read them
                raise self._died(other, f"exited during {what}")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's output.

        Raises:
            WorkerDiedError: a rank failed or exited (the engine is dead after this).
            TimeoutError: a rank did not answer within worker_timeout_s.
        """
        if self._closed:
            raise WorkerDiedError("the executor is shut down")
        t0 = time.perf_counter()
        msg = ExecuteModel(scheduler_output=scheduler_output)
        for rank in range(self.world_size):
            self._send(rank, msg)
        deadline = time.monotonic() + self.timeout_s
        results = [self._recv(rank, deadline, "a step") for rank in range(self.world_size)]
        steps = [r for r in results if isinstance(r, StepResult)]
        now = time.monotonic()  # each rank's deadline on this process's clock
        self._deadlines = [None if s.connector_deadline_in_s is None
                           else now + s.connector_deadline_in_s for s in steps]
        forward = steps[0].forward_s if steps else 0.0
        self.timings = StepTimings(
            forward=forward,
            sample=max(0.0, time.perf_counter() - t0 - forward),
            dcp_comm=steps[0].dcp_comm_s if steps else 0.0,
            pcp_comm=max((s.pcp_comm_s for s in steps), default=0.0),
        )
        out = steps[0].output
        out.kv_connector_output = self._kv_outputs.aggregate(
            [s.output.kv_connector_output for s in steps]
        )
        return out

    def read_kv_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Every rank's copy of these blocks of KV cache group 0 (inspection: tests compare a
        DCP shard with the producer's KV). Returns per rank a torch tensor [len(block_ids), layers,
        2, block_size, local KV heads, head_size].

        Raises:
            WorkerDiedError / TimeoutError: as execute_model.
        """
        import torch

        for rank in range(self.world_size):
            self._send(rank, ReadKVBlocks(block_ids=list(block_ids)))
        deadline = time.monotonic() + self.timeout_s
        out = []
        for rank in range(self.world_size):
            msg = self._recv(rank, deadline, "a KV read")
            assert isinstance(msg, KVBlocks)
            dtype = getattr(torch, msg.dtype)
            out.append(
                torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).view(msg.shape)
            )
        return out

    def shutdown(self) -> None:
        """Stop the wakeup listener, ask every worker to stop, then end the ones still alive
        after a grace period."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(self._encoder.encode(Shutdown()))
        deadline = time.monotonic() + 10.0
        local = [p for p in self._procs if p is not None]
        for proc in local:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in local:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, 9)
                proc.join(1.0)
        for conn in self._conns:
            conn.close()
        for remote in self._remote.values():
            remote.close()
