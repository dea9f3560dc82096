"""ZMQ publisher of KV event batches, on vLLM's transport (`ZmqEventPublisher` in
vllm/distributed/kv_events.py):

- PUB socket: every batch is one multipart message (topic frame, sequence number as 8 bytes
  big-endian unsigned, payload = msgpack `KVEventBatch` with its events in the configured
  `event_encoding`, schema.py); sequence numbers start at 0 per run and grow by one per batch
  sent.
- ROUTER socket (optional, `replay_endpoint`): a client (REQ, or DEALER sending an empty delimiter
  frame first) sends a start sequence number as 8 bytes big-endian; the answer is one message
  (sequence, payload) per buffered batch from that number on, then the end marker (-1 as 8 bytes
  big-endian signed, empty payload). The last `buffer_steps` batches are kept, as the bytes
  that were published, so a replay has the same encoding.

pdkv's differences: the topic frame is `<topic>|<engine id>|<epoch>` (schema.topic_frame) so a
consumer knows who sent a batch and when that engine restarted (the epoch: milliseconds since
the Unix epoch at start); both endpoints are always bound (vLLM connects the PUB socket unless
the address has a wildcard); a malformed replay request is dropped and counted (vLLM logs it);
publish() never blocks (a full queue drops the batch and counts it; vLLM's put waits).

One background thread owns the sockets after start-up; every wait in it has a timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import replace

import zmq

from pdkv.kv_events.base import KVEventCounters, KVEventPublisher, KVEventsInfo
from pdkv.kv_events.config import KVEventsConfig
from pdkv.kv_events.schema import TOPIC_SEPARATOR, KVEventBatch, encode_batch, topic_frame

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame of the replay end marker."""

_POLL_S = 0.05  # longest the thread waits for a batch before it looks at the replay socket
_REPLAYS_PER_TURN = 16  # replay requests served between two batches at most
_CLOSE_LINGER_MS = 500  # at shutdown, how long ZMQ may still flush sent batches to subscribers


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class ZmqEventPublisher(KVEventPublisher):
    """PUB (+ ROUTER for replay) publisher with a bounded queue and a replay buffer.

    Args:
        config: the engine's `--kv-events-config`.
        engine_id: goes into every topic frame (no `|`).

    Raises:
        ValueError: an endpoint cannot be bound (in use, bad address), or the engine id has `|`.
    """

    def __init__(self, config: KVEventsConfig, engine_id: str) -> None:
        if not engine_id or TOPIC_SEPARATOR in engine_id:
            raise ValueError(f"engine id must be non-empty without {TOPIC_SEPARATOR!r}: "
                             f"{engine_id!r}")
        self.config = config
        self.engine_id = engine_id
        self.epoch = time.time_ns() // 1_000_000
        self._topic = topic_frame(config.topic, engine_id, self.epoch)
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._counters = KVEventCounters()
        self._next_seq = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pub = self._bind(zmq.PUB, config.endpoint, "endpoint")
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint is not None:
            try:
                self._replay = self._bind(zmq.ROUTER, config.replay_endpoint, "replay_endpoint")
            except ValueError:
                self._pub.close(linger=0)
                self._ctx.term()
                raise
        self._thread = threading.Thread(target=self._run, name="pdkv-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay: %s, topic %r)", self.endpoint,
                    self.replay_endpoint, self._topic.decode())

    def _bind(self, kind: int, address: str, field: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUB:
            sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            if kind == zmq.PUB:
                self._ctx.term()
            raise ValueError(f"--kv-events-config {field} {address!r}: cannot bind: {e}") from None
        return sock

    # ------------------------------------------------------------- engine thread
    @property
    def endpoint(self) -> str:
        """The PUB socket's bound address (the real port when the config asked for `:0`)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER socket's bound address, or None."""
        return None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:  # as vLLM's publisher: its DP rank (pdkv: 0)
            batch = KVEventBatch(batch.ts, batch.events, 0)
        if self._stop.is_set():
            self._counters.batches_dropped += 1
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._counters.batches_dropped += 1

    def count_dropped_events(self, n: int) -> None:
        self._counters.events_dropped += n

    def counters(self) -> KVEventCounters:
        return replace(self._counters)

    def info(self, block_size: int) -> KVEventsInfo:
        return {"publisher": self.config.publisher, "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "topic": self.config.topic,
                "engine_id": self.engine_id, "epoch": self.epoch,
                "event_encoding": self.config.event_encoding, "block_size": block_size}

    def shutdown(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV event publisher thread still running after %.1f s", timeout_s)
            return  # it owns the sockets; a daemon thread, it ends with the process
        self._ctx.term()  # waits for the PUB socket's linger at most

    # ---------------------------------------------------------- publisher thread
    def _run(self) -> None:
        try:
            while True:
                self._serve_replays()
                if self._stop.is_set():
                    self._drain()
                    return
                try:
                    batch = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                self._send(batch)
        finally:
            self._pub.close(linger=_CLOSE_LINGER_MS)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _drain(self) -> None:
        """Send what the engine queued before shutdown (the caller's join bounds the time)."""
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            self._send(batch)

    def _send(self, batch: KVEventBatch) -> None:
        payload = encode_batch(batch, self.config.event_encoding)
        seq = self._next_seq
        try:
            # PUB never blocks (it drops for a subscriber past its HWM); NOBLOCK makes sure.
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("KV event batch not sent: %s", e)
            self._counters.batches_dropped += 1
            return
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._counters.batches_published += 1
        self._counters.events_published += len(batch.events)

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        for _ in range(_REPLAYS_PER_TURN):
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                logger.warning("KV event replay socket: %s", e)
                return
            self._answer(frames)

    def _answer(self, frames: list[bytes]) -> None:
        """Answer one replay request: [client identity, empty delimiter, 8-byte start seq]."""
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self._counters.replay_malformed += 1
            logger.debug("malformed KV event replay request dropped (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        self._counters.replay_requests += 1
        try:
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart(  # type: ignore[union-attr]
                        (client, b"", seq_bytes(seq), payload), flags=zmq.NOBLOCK)
            self._replay.send_multipart(  # type: ignore[union-attr]
                (client, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the client left, or its pipe is full: it asks again
            logger.debug("KV event replay answer cut short: %s", e)
