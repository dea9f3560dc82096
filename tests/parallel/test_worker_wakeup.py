"""Connector wakeups from worker processes (pdkv/executor/wakeup.py).

The pipe's two ends alone: a worker's wake never blocks, even while the pipe is full, and a burst
becomes one message; the engine's listener wakes the loop per batch, drops a pipe at EOF (a dead
worker) without spinning on it, and ends on close.

End to end: a DCP 2 consumer (two worker processes) under AsyncLLM, its pull held up at the
producer. While the load waits the engine loop sleeps (no steps, little CPU in the engine and its
workers, read from /proc), and when the load finishes the worker halves' wakeup, sent over the
executor's wakeup pipes, resumes the request at once, with the colocated engine's tokens. Lease
120 s and transfer timeout 60 s: the consumer's earliest deadline (a lease renewal) is 40 s away,
so only the wakeup can explain a resume within RESUME_S. Issue 31, acceptance 4."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import msgspec
import pytest
from pd_tp_utils import BLOCK, GREEDY, engine, kv_config

from pdkv import SamplingParams
from pdkv.engine.async_llm import AsyncLLM
from pdkv.executor.messages import ConnectorWakeup
from pdkv.executor.wakeup import WakeupListener, WakeupSender
from pdkv.kv_transfer.connector.p2p_messages import Claim

TIMEOUTS = {"kv_lease_duration": 120.0, "transfer_timeout": 60.0}
WAIT_S = 2.0  # how long the held-up load is watched
MAX_STEPS = 2  # steps the consumer may take meanwhile (the 5 ms poll took about 150 a second)
# CPU seconds per second, engine process and workers together: about 0.01 asleep, 0.1 under the
# 5 ms poll, about 1 with a thread spinning; /proc counts in 10 ms ticks.
MAX_CPU_SHARE = 0.1
RESUME_S = 20.0  # from the producer's answer to the decoded request; the next deadline is 40 s


def _cpu_seconds(stat_paths: list[str]) -> float:
    """utime + stime from these /proc/.../stat files (a process: all its threads)."""
    total = 0
    for path in stat_paths:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class _StuckPipe:
    """A write end whose first send blocks until `release` is set (a full pipe)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sent: list[bytes] = []
        self.closed = False

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)
        if len(self.sent) == 1:
            self.release.wait(30.0)

    def close(self) -> None:
        self.closed = True


def test_wake_never_blocks_and_a_burst_becomes_one_message():
    pipe = _StuckPipe()
    sender = WakeupSender(pipe, rank=1)  # type: ignore[arg-type]
    sender.wake()
    _wait_for(lambda: len(pipe.sent) == 1, 10.0, "the first wake was not sent")
    for _ in range(10_000):  # the sender's thread is stuck in a send meanwhile
        sender.wake()
    assert len(pipe.sent) == 1
    pipe.release.set()
    _wait_for(lambda: len(pipe.sent) == 2, 10.0, "the coalesced wake was not sent")
    time.sleep(0.2)
    assert len(pipe.sent) == 2, "a burst of wakes is one message"
    assert msgspec.msgpack.decode(pipe.sent[1], type=ConnectorWakeup) == ConnectorWakeup(rank=1)
    sender.close()
    assert pipe.closed


def test_listener_wakes_per_batch_drops_a_dead_pipe_and_ends_on_close():
    (r0, w0), (r1, w1) = mp.Pipe(duplex=False), mp.Pipe(duplex=False)
    listener = WakeupListener([r0, r1])
    woken = threading.Semaphore(0)
    listener.set_wakeup(woken.release)
    message = msgspec.msgpack.encode(ConnectorWakeup(rank=0))
    w0.send_bytes(message)
    assert woken.acquire(timeout=10.0), "no wakeup for a message"
    w1.close()  # rank 1's process exited
    assert woken.acquire(timeout=10.0), "no wakeup for a dead worker"
    thread = listener._thread
    stat = [f"/proc/self/task/{thread.native_id}/stat"]
    cpu0 = _cpu_seconds(stat)
    time.sleep(0.5)
    assert _cpu_seconds(stat) - cpu0 < 0.2, "the listener spins on a closed pipe"
    w0.send_bytes(message)  # the live rank still wakes the loop
    assert woken.acquire(timeout=10.0)
    listener.close()
    assert not thread.is_alive()
    assert r0.closed and r1.closed
    w0.close()


async def _final(llm: AsyncLLM, prompt: list[int], params: SamplingParams,
                 kv: dict[str, Any]) -> Any:
    request, text = llm.make_request({"prompt_token_ids": prompt}, params, kv_transfer_params=kv)
    final = None
    async for out in llm.generate(request, text):
        final = out
    return final


@pytest.mark.slow  # worker processes
def test_dcp_consumer_sleeps_while_its_load_waits_and_resumes_on_the_wakeup(tiny_llama_kv1):
    prompt = [(i * 7919 + 13) % 30000 + 100 for i in range(70)]
    ref = engine(tiny_llama_kv1)
    try:
        want = list(ref.generate([{"prompt_token_ids": prompt}], GREEDY,
                                 use_tqdm=False)[0].outputs[0].token_ids)
    finally:
        ref.llm_engine.shutdown()
    p_engine = engine(tiny_llama_kv1, kv_transfer_config=kv_config("kv_producer", **TIMEOUTS))
    d_engine = engine(tiny_llama_kv1, tensor_parallel_size=2, decode_context_parallel_size=2,
                      cp_kv_cache_interleave_size=BLOCK,
                      kv_transfer_config=kv_config("kv_consumer", **TIMEOUTS)).llm_engine
    # The producer answers no claim until `gate` opens: D's pulls wait inside its ranks.
    producer_side = p_engine.llm_engine.runner.connector.worker.producer
    real_handle = producer_side._handle
    gate, claims, lock = threading.Event(), [0], threading.Lock()

    def handle(msg: Any) -> Any:
        if isinstance(msg, Claim):
            with lock:
                claims[0] += 1
            gate.wait(90.0)
        return real_handle(msg)

    producer_side._handle = handle
    p, d = AsyncLLM(p_engine.llm_engine), AsyncLLM(d_engine)
    p.start()
    d.start()
    stats = [f"/proc/{pid}/stat" for pid in (os.getpid(), *d_engine.executor.pids)]
    try:
        async def main() -> tuple[Any, int, float, float]:
            leg = await _final(p, prompt, SamplingParams(temperature=0, max_tokens=1),
                               {"do_remote_decode": True})
            task = asyncio.create_task(_final(d, prompt, GREEDY, leg.kv_transfer_params))
            deadline = time.monotonic() + 60.0
            while claims[0] < 2:  # both DCP ranks claimed: their pulls wait at the producer
                assert time.monotonic() < deadline, "D's ranks did not claim the grant"
                assert not task.done(), f"the request ended first: {task.result()}"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the step that started the pulls has returned
            steps0, cpu0, t0 = d_engine.num_steps, _cpu_seconds(stats), time.monotonic()
            await asyncio.sleep(WAIT_S)
            steps = d_engine.num_steps - steps0
            share = (_cpu_seconds(stats) - cpu0) / (time.monotonic() - t0)
            assert not task.done()
            gate.set()
            t1 = time.monotonic()
            out = await task
            return out, steps, share, time.monotonic() - t1

        out, steps, share, resumed = asyncio.run(asyncio.wait_for(main(), 180))
        assert steps <= MAX_STEPS, f"the idle consumer stepped {steps} times in {WAIT_S} s"
        assert share < MAX_CPU_SHARE, f"the idle consumer used {share:.2f} CPU s per s"
        assert out.finished and list(out.outputs[0].token_ids) == want
        assert resumed < RESUME_S, (
            f"the request resumed {resumed:.1f} s after the load could finish: it waited for a "
            "deadline, not the workers' wakeup"
        )
        assert d.call(lambda e: e.scheduler.kv_stats.get("kv_transfers", 0)) >= 1
    finally:
        gate.set()
        d.shutdown()
        p.shutdown()
