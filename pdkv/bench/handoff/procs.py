"""The two engine processes of `pdkv bench handoff`: a prefill and a decode peer
(pdkv.bench.handoff.peer) driven by JSON lines, optionally inside a network-namespace pair, and
the prompts they are given. Shared by the handoff-time run (cli.py) and the transfer-mode run
(modes.py)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO

from pdkv.bench.handoff.peer import HandoffRequest
from pdkv.bench.netns import NetnsPair
from pdkv.jsontypes import JSONObject
from pdkv.launch.netns import unavailable_reason

MODEL_MAX_LEN = 8192  # SmolLM2's max_position_embeddings
BLOCK_TOKENS = 16
READY_TIMEOUT_S = 300.0
REPLY_TIMEOUT_S = 1200.0
VOCAB_LOW, VOCAB_HIGH = 1000, 49152


class Peer:
    """A handoff_peer process: JSON lines in, JSON lines out, stderr to a log file."""

    def __init__(self, argv: list[str], log_path: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def _log_tail(self) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-15:])

    def recv(self, timeout: float) -> str:
        """The next JSON reply line; raises RuntimeError on exit, timeout or an {"error"} reply."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(
                f"no reply within {timeout:g} s; log tail:\n{self._log_tail()}"
            ) from None
        if line is None:
            raise RuntimeError(
                f"peer exited (rc {self.proc.wait(10)}); log tail:\n{self._log_tail()}"
            )
        msg: JSONObject = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"peer failed: {msg['error']}; log tail:\n{self._log_tail()}")
        return line

    def call(self, msg: HandoffRequest, timeout: float = REPLY_TIMEOUT_S) -> str:
        """Send `msg`, return the reply line (as `recv`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.recv(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """EOF on stdin, then wait; kill after `timeout` s."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def prompt_tokens(length: int, seed: int) -> list[int]:
    """`length` token ids drawn uniformly from [1000, 49152) (clear of special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


def capped_lengths(prompt_lens: Sequence[int], max_model_len: int = MODEL_MAX_LEN) -> list[int]:
    """Prompt lengths clipped to max_model_len − 1 (one position stays free for the output
    token), in the given order without duplicates.

    Raises:
        ValueError: an empty list or a length < 1.
    """
    if not prompt_lens or any(n < 1 for n in prompt_lens):
        raise ValueError(f"prompt lengths must be >= 1, got {list(prompt_lens)}")
    return list(dict.fromkeys(min(n, max_model_len - 1) for n in prompt_lens))


@contextlib.contextmanager
def peers(
    transfer: str, lens: Sequence[int], pair: NetnsPair | None, log_dir: str,
    transfer_mode: str = "pull",
    prefault: bool = True,
) -> Iterator[tuple[Peer, Peer]]:
    """Start P and D (pdkv.bench.handoff.peer) for `transfer`, sized for the longest of `lens`,
    in `pair`'s namespaces when given; yield them once both are ready, stop both on exit.
    `prefault`: both write their whole KV cache at start (`--kv-cache-prefault`), so no pull
    lands in pages touched for the first time.

    Raises:
        RuntimeError: a peer exited or was not ready within READY_TIMEOUT_S.
    """
    max_len = min(MODEL_MAX_LEN, max(lens) + BLOCK_TOKENS)
    blocks = -(-max_len // BLOCK_TOKENS) + 8  # the longest prompt plus the probe
    common = [
        "--transfer",
        transfer,
        "--num-kv-blocks",
        str(blocks),
        "--max-model-len",
        str(max_len),
        "--transfer-mode",
        transfer_mode,
        *(["--kv-cache-prefault"] if prefault else []),
    ]
    py = [sys.executable, "-m", "pdkv.bench.handoff.peer"]
    host = pair.host("p") if pair else "127.0.0.1"
    p_argv = (pair.exec_prefix("p") if pair else []) + py + ["p", "--host", host] + common
    d_host = pair.host("d") if pair else "127.0.0.1"  # (push: where P writes)
    d_argv = (pair.exec_prefix("d") if pair else []) + py + ["d", "--host", d_host] + common
    p = Peer(p_argv, os.path.join(log_dir, f"p-{transfer}-{transfer_mode}.log"))
    d = None
    try:
        d = Peer(d_argv, os.path.join(log_dir, f"d-{transfer}-{transfer_mode}.log"))
        p.recv(READY_TIMEOUT_S)
        d.recv(READY_TIMEOUT_S)
        yield p, d
    finally:
        if d is not None:
            d.close()
        p.close()


def link_unavailable(link_rate: str | None, say: Callable[..., object]) -> str | None:
    """With `link_rate`, why the namespace pair cannot be made here (said as a skip), else None
    (also without a link rate: loopback needs nothing)."""
    if not link_rate:
        return None
    reason = unavailable_reason()
    if reason:
        say(f"pdkv bench handoff --link-rate {link_rate}: skipped: {reason}")
    return reason
