"""The soak's sampler: every few seconds, each process's RSS, open fds and threads (/proc, the
process with its descendants), each engine's free KV blocks, queue depths and pool gauges
(/metrics), the redis server's used memory (INFO), and the client's requests in flight.

One sample is a flat dict of floats keyed "<process>.<what>" (e.g. "decode.rss_bytes",
"prefill.free_blocks", "redis.used_memory"), plus "t" (seconds since the sampler started) and
"load1" (the 1-minute load average); a value that cannot be read is left out of that sample.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from typing import IO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdkv.bench.memory import descendants, tree_rss

# /metrics sample name -> the sample key's suffix (summed over labels).
ENGINE_METRICS = {
    "pdkv:num_free_blocks": "free_blocks",
    "pdkv:num_requests_waiting": "waiting",
    "pdkv:num_requests_running": "running",
    "pdkv:kv_pool_bytes_in_use": "pool_bytes_in_use",
    "pdkv:kv_pool_save_queue_depth": "pool_save_queue",
}


def proc_counts(pid: int) -> dict[str, float]:
    """rss_bytes, fds and threads of `pid` plus its descendants (Linux /proc).

    Raises:
        OSError: `pid` is gone.
    """
    rss = float(tree_rss(pid).total)
    fds = threads = 0
    for p in [pid, *descendants(pid)]:
        try:
            fds += len(os.listdir(f"/proc/{p}/fd"))
            with open(f"/proc/{p}/status") as f:
                threads += next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        except (OSError, StopIteration):
            if p == pid:
                raise
    return {"rss_bytes": rss, "fds": float(fds), "threads": float(threads)}


def engine_metrics(client: httpx.Client, url: str,
                   names: dict[str, str] = ENGINE_METRICS) -> dict[str, float]:
    """The /metrics samples of one engine named in `names` (sample name -> key), each summed
    over its labels; empty when the engine does not answer."""
    try:
        text = client.get(url + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = names.get(s.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + s.value
    return out


class Sampler:
    """Takes a sample every `interval` seconds on its own thread until stop(); each sample is kept
    in `samples` and written as one JSON line to `out`.

    Args:
        pids: process name -> pid (its descendants are counted with it).
        engines: engine name -> base URL (its /metrics is read).
        redis_url: the pool's redis server ("redis://host:port/db"), or None.
        extra: called at each sample for more keys (e.g. the client's requests in flight).
    """

    def __init__(self, pids: dict[str, int], engines: dict[str, str], redis_url: str | None,
                 interval: float, out: IO[str], extra: Callable[[], dict[str, float]]) -> None:
        self.pids = pids
        self.engines = engines
        self.redis_url = redis_url
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self._out = out
        self._extra = extra
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdkv-soak-sampler", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stop after the sample in progress (waits at most interval + 30 s)."""
        self._stop.set()
        self._thread.join(self.interval + 30.0)

    def sample(self, client: httpx.Client) -> dict[str, float]:
        """One sample, now (also recorded)."""
        row: dict[str, float] = {"t": time.monotonic() - self._t0, "load1": os.getloadavg()[0]}
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError):
                row.update({f"{name}.{k}": v for k, v in proc_counts(pid).items()})
        for name, url in self.engines.items():
            row.update({f"{name}.{k}": v for k, v in engine_metrics(client, url).items()})
        if self.redis_url:
            with contextlib.suppress(Exception):  # a redis that does not answer: no value
                import redis

                r = redis.Redis.from_url(self.redis_url, socket_timeout=5.0)
                try:
                    row["redis.used_memory"] = float(r.info("memory")["used_memory"])
                finally:
                    r.close()
        row.update(self._extra())
        self.samples.append(row)
        self._out.write(json.dumps(row) + "\n")
        self._out.flush()
        return row

    def _run(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                started = time.monotonic()
                self.sample(client)
                self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
