"""The periodic stats line and the per-request line of `pdkv serve` (fed fake step outputs)."""

from __future__ import annotations

from pdkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdkv.sched.output import SchedulerStats
from pdkv.serve.stats_log import RequestLogger, StatsLogger


def _out(rid: str, prompt: int, cached: int, tokens: int, new: int, finished: bool = False,
         kv: dict[str, int] | None = None, external: int = 0) -> RequestOutput:
    comp = CompletionOutput(0, "", list(range(tokens)), "length" if finished else None,
                            delta_token_ids=list(range(new)))
    m = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.1,
        first_token_time=10.25,
        last_token_time=11.0,
        finished_time=11.0 if finished else None,
        num_output_tokens=tokens,
        kv_wait_time=0.040,
        num_external_tokens=external,
    )
    return RequestOutput(rid, None, list(range(prompt)), [comp], finished, num_cached_tokens=cached,
                         kv_load_bytes=kv or {}, metrics=m)


def _stats(running: int, waiting: int = 0, queries: int = 0, hits: int = 0) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=0.125,
        num_free_blocks=7,
        num_preemptions=0,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
    )


def test_stats_line_every_interval_while_busy():
    lines: list[str] = []
    log = StatsLogger(interval_s=10.0, log=lines.append)
    log.observe([], _stats(0), 0.0)
    # A 100-token prompt with 40 cached: 60 computed; then 1 + 9 generated tokens.
    log.observe([_out("a", 100, 40, 1, 1)], _stats(1, 2, queries=100, hits=40), 1.0)
    log.observe([_out("a", 100, 40, 10, 9)], _stats(1, 2, queries=100, hits=40), 5.0)
    assert lines == []  # not yet 10 s
    log.observe([], _stats(1, 2, queries=100, hits=40), 10.0)
    assert lines == [
        "Avg prompt throughput: 6.0 tokens/s, Avg generation throughput: 1.0 tokens/s, "
        "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%"
    ]
    # Idle interval: nothing written; the next busy one counts from its own start.
    log.observe([], _stats(0), 20.0)
    assert len(lines) == 1
    log.observe([_out("a", 100, 40, 15, 5, finished=True)], _stats(0), 25.0)
    log.observe([], _stats(0), 30.0)
    assert (
        len(lines) == 2
        and "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.5 " in lines[1]
    )


def test_request_line_names_cached_pulled_bytes_pull_time_ttft():
    lines: list[str] = []
    log = RequestLogger(log=lines.append)
    log.observe([_out("r1", 100, 40, 5, 5)], _stats(1), 0.0)
    assert lines == []  # not finished
    log.observe(
        [_out("r1", 100, 48, 8, 3, finished=True, kv={"p2p": 32_000}, external=32)], _stats(0), 1.0
    )
    assert lines == [
        "finished request r1: prompt_tokens=100 cached_tokens=48 pulled_tokens=32 kv_bytes=32000 "
        "(p2p=32000) pull_ms=40.0 ttft_ms=250.0 output_tokens=8 finish_reason=length"
    ]
