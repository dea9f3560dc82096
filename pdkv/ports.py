"""The one way pdkv's launchers, benchmarks and tests pick a free loopback TCP port."""

from __future__ import annotations

import contextlib
import random
import socket


def free_port(taken: set[int] | None = None, host: str = "127.0.0.1", low: int = 20000,
              high: int = 32000, count: int = 1) -> int:
    """A free TCP port below Linux's ephemeral range (32768+), so that outgoing connections of
    other processes cannot grab it between this choice and the child's bind; `taken` collects
    the ports already handed out. With `count` > 1, the first of `count` consecutive free ports
    (a multi-rank engine's rank r listens on port + r), all added to `taken`.

    Raises:
        RuntimeError: no such port (run) found in 200 tries.
    """
    taken = set() if taken is None else taken
    for _ in range(200):
        port = random.randint(low, high - count + 1)
        run = range(port, port + count)
        if any(p in taken for p in run):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for p in run:
                    stack.enter_context(socket.socket()).bind((host, p))
            except OSError:
                continue
        taken.update(run)
        return port
    raise RuntimeError(f"no {count} free consecutive port(s) in {low}-{high}")
