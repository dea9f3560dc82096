"""What `pdkv serve` writes to its log while serving (like vLLM's LoggingStatLogger and request
logging): a periodic stats line while busy and one line per finished request.

Both are step observers: `observe(outputs, stats, now)` is called from the engine loop thread
after every engine step (`pdkv.engine.async_llm.AsyncLLM`'s step_observer) with that step's
outputs, the scheduler's gauges and the step end time (time.monotonic(), seconds). They read
the outputs and stats only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pdkv.outputs import RequestOutput
from pdkv.sched.output import SchedulerStats

logger = logging.getLogger("pdkv.serve")

DEFAULT_STATS_INTERVAL_S = 10.0


@dataclass
class StatsLogger:
    """Every `interval_s` seconds while the engine is busy, one line (vLLM's wording):

    "Avg prompt throughput: P tokens/s, Avg generation throughput: G tokens/s, Running: R reqs,
    Waiting: W reqs, KV cache usage: U%, Prefix cache hit rate: H%"

    P counts prompt tokens the engine computed (prompt minus cached or loaded tokens) of requests
    whose first token came in the interval; G the generated tokens; both divided by the
    interval's length. H is hits / queries of the prefix cache (tokens) over the interval (over
    the whole run when the interval had no query). Idle intervals (nothing running or waiting,
    no token) write nothing.
    """

    interval_s: float = DEFAULT_STATS_INTERVAL_S
    log: Callable[[str], None] = logger.info
    _last_t: float | None = None
    _prompt_tokens: int = 0
    _gen_tokens: int = 0
    _prefix_at_last: tuple[int, int] = (0, 0)
    _started: set[str] = field(default_factory=set)

    def observe(self, outputs: list[RequestOutput], stats: SchedulerStats, now: float) -> None:
        if self._last_t is None:
            self._last_t = now
            self._prefix_at_last = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        for out in outputs:
            comp = out.outputs[0] if out.outputs else None
            self._gen_tokens += len(comp.delta_token_ids) if comp else 0
            first = comp is not None and bool(comp.token_ids)
            if first and out.request_id not in self._started:
                self._started.add(out.request_id)
                self._prompt_tokens += max(0, len(out.prompt_token_ids) - out.num_cached_tokens)
            if out.finished:
                self._started.discard(out.request_id)
        elapsed = now - self._last_t
        if elapsed < self.interval_s:
            return
        busy = stats.num_running or stats.num_waiting or self._prompt_tokens or self._gen_tokens
        if busy:
            self.log(self.line(elapsed, stats))
        self._last_t = now
        self._prompt_tokens = self._gen_tokens = 0
        self._prefix_at_last = (stats.prefix_cache_queries, stats.prefix_cache_hits)

    def line(self, elapsed: float, stats: SchedulerStats) -> str:
        """The stats line for an interval of `elapsed` seconds ending with `stats`."""
        queries = stats.prefix_cache_queries - self._prefix_at_last[0]
        hits = stats.prefix_cache_hits - self._prefix_at_last[1]
        if queries <= 0:
            queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
        return (
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._gen_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )


@dataclass
class RequestLogger:
    """One line per finished request (P/D: each engine writes its own leg's):

    "finished request ID: prompt_tokens=N cached_tokens=C pulled_tokens=K kv_bytes=B
    (p2p=.., pool=..) pull_ms=X ttft_ms=Y output_tokens=O finish_reason=R"

    cached_tokens: prompt tokens not computed here (local prefix cache hits plus tokens loaded by
    a KV connector); pulled_tokens: the loaded share (metrics.num_external_tokens, counted by the
    scheduler); pull_ms: time waiting for an asynchronous KV load
    (metrics.kv_wait_time); ttft_ms: arrival to first token in this engine.
    """

    log: Callable[[str], None] = logger.info

    def observe(self, outputs: list[RequestOutput], stats: SchedulerStats, now: float) -> None:
        for out in outputs:
            if out.finished:
                self.log(self.line(out))

    def line(self, out: RequestOutput) -> str:
        """The line for the final output `out`."""
        kv_bytes = sum(out.kv_load_bytes.values())
        paths = ", ".join(f"{k}={v}" for k, v in sorted(out.kv_load_bytes.items()))
        m = out.metrics
        pulled = m.num_external_tokens if m is not None else 0
        ttft = m.ttft if m is not None else None
        pull_ms = 1000.0 * m.kv_wait_time if m is not None else 0.0
        comp = out.outputs[0] if out.outputs else None
        return (
            f"finished request {out.request_id}: prompt_tokens={len(out.prompt_token_ids)} "
            f"cached_tokens={out.num_cached_tokens} pulled_tokens={pulled} kv_bytes={kv_bytes}"
            + (f" ({paths})" if paths else "")
            + f" pull_ms={pull_ms:.1f} ttft_ms={'n/a' if ttft is None else f'{1000.0 * ttft:.1f}'}"
            f" output_tokens={len(comp.token_ids) if comp else 0}"
            f" finish_reason={comp.finish_reason if comp else None}"
        )
