"""Entry point of one worker process: join torch.distributed, load this rank's shard, run steps.

Started by `MultiprocExecutor` (multiprocessing "spawn" context) with one end of its step pipe and
the write end of its wakeup pipe, or on a headless node (pdkv.executor.headless) with its two TCP
channels to the leader (pdkv.executor.channel); every message on either is msgpack
(pdkv.executor.messages), never pickle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import traceback
from typing import TYPE_CHECKING

import msgspec

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
from pdkv.executor.wakeup import WakeupSender

if TYPE_CHECKING:
    from pdkv.cache.specs import KVCacheConfig
    from pdkv.executor.channel import RankChannel
    from pdkv.model.arch_config import LlamaArchConfig

logger = logging.getLogger(__name__)


def run_worker(conn: RankChannel, wake_conn: RankChannel) -> None:
    """Serve one rank until Shutdown, EOF on the step channel (the engine is gone) or an error.

    The first message must be WorkerInit; with its `node_host` set (ranks on several nodes),
    gloo uses the interface of that address and the KV connector's servers bind and advertise
    it (pdkv.executor.nodes). An exception is reported as WorkerFailed (with its
    traceback) before the process exits with code 1. The KV connector worker half, if any, wakes
    the engine loop through `wake_conn` (a `WakeupSender`); its next deadline goes back with each
    step's result.
    """
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    rank = -1

    def send(msg: FromWorker) -> None:
        conn.send_bytes(encoder.encode(msg))

    ctx = runner = None
    sender: WakeupSender | None = None
    try:
        init = decoder.decode(conn.recv_bytes())
        if not isinstance(init, WorkerInit):
            raise RuntimeError(f"first message must be WorkerInit, got {type(init).__name__}")
        rank = init.rank
        import torch

        torch.set_num_threads(init.num_threads)
        from pdkv.kv_transfer.connector.spec import connector_spec
        from pdkv.parallel.context import init_distributed
        from pdkv.worker.model_runner import ModelRunner

        par, model_config = init.parallel_config, init.model_config
        kvt = init.kv_transfer_config  # this process's copy: its spec is parsed once, here
        if init.node_host:
            from pdkv.executor.nodes import at_node_host, use_gloo_interface

            use_gloo_interface(init.node_host)
            kvt = at_node_host(kvt, init.node_host)
        cuda = model_config.device.startswith("cuda")
        if model_config.device == "cuda":  # one GPU per rank (nccl needs distinct devices)
            model_config = dataclasses.replace(
                model_config, device=f"cuda:{rank % torch.cuda.device_count()}"
            )
            torch.cuda.set_device(torch.device(model_config.device))
        ctx = init_distributed(
            par.layout(),
            rank,
            init.init_method,
            backend="nccl" if cuda else "gloo",
            timeout_s=par.worker_timeout_s,
        )

        def kv_cache_from_engine(arch: LlamaArchConfig, budget_bytes: int | None) -> KVCacheConfig:
            """Report this rank's budget; the engine sizes the KV cache once for every rank."""
            send(WorkerLoaded(rank=rank, kv_budget_bytes=budget_bytes))
            msg = decoder.decode(conn.recv_bytes())
            if not isinstance(msg, InitKVCache):
                raise RuntimeError(f"expected InitKVCache, got {type(msg).__name__}")
            return msg.to_config()

        logical_block = init.cache_config.block_size * par.decode_context_parallel_size
        spec = connector_spec(kvt, logical_block) if kvt is not None else None
        runner = ModelRunner(model_config, init.cache_config, spec, ctx, kv_cache_from_engine,
                             node_host=init.node_host)
        if runner.connector is not None:
            sender = WakeupSender(wake_conn, rank)
            runner.connector.set_wakeup(sender.wake)
        send(WorkerReady(rank=rank, layout=runner.kv_layout.to_wire(),
                         vocab_size=runner.vocab_size, eos_token_id=runner.eos_token_id,
                         control_address=list(runner.connector_startup.control_address or []),
                         pool_lookup_address=list(
                             runner.connector_startup.pool_lookup_address or [])))
        while True:
            try:
                msg = decoder.decode(conn.recv_bytes())
            except EOFError:
                return
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, ReadKVBlocks):
                t = (
                    runner.kv_cache_groups[0][torch.tensor(msg.block_ids, dtype=torch.long)]
                    .contiguous()
                    .cpu()
                )
                send(
                    KVBlocks(
                        rank=rank,
                        data=t.view(torch.uint8).numpy().tobytes(),
                        shape=list(t.shape),
                        dtype=str(t.dtype).removeprefix("torch."),
                    )
                )
                continue
            if not isinstance(msg, ExecuteModel):
                raise RuntimeError(f"unexpected message {type(msg).__name__}")
            sched_out = msg.scheduler_output
            meta = sched_out.kv_connector_metadata
            if meta is not None and runner.connector is not None:
                # Sent as a plain map (the field is untyped): rebuild the connector's own type.
                sched_out.kv_connector_metadata = runner.connector.metadata_from_wire(meta)
            out = runner.execute_model(sched_out)
            deadline = runner.connector.next_deadline() if runner.connector is not None else None
            send(StepResult(rank=rank, output=out, forward_s=runner.timings.forward,
                            dcp_comm_s=runner.timings.dcp_comm,
                            pcp_comm_s=runner.timings.pcp_comm,
                            connector_deadline_in_s=(None if deadline is None
                                                     else deadline - time.monotonic())))
    except BaseException as e:  # reported to the engine, then the process ends
        with contextlib.suppress(OSError, ValueError):
            send(WorkerFailed(rank=rank, error="".join(traceback.format_exception(e))))
        raise SystemExit(1) from None
    finally:
        if runner is not None:
            runner.shutdown()
        if sender is not None:
            sender.close()
        else:
            wake_conn.close()
        if ctx is not None:
            ctx.destroy()
