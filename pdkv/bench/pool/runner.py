"""The `pdkv bench pool` run: the no-pool engine, then one engine per tier (a pool of that single
tier), cold then hot TTFT of the same random-token prompts, in one process."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from pdkv.bench.pool.report import (
    ColdHot,
    PoolResult,
    PoolSample,
    TierSummary,
    format_table,
    max_loadable_tokens,
    summarize_tier,
)

TIERS = ("dram", "disk", "redis", "mooncake")
DRAM_CAPACITY_BYTES = 1 << 30
DISK_CAPACITY_BYTES = 4 << 30
MOONCAKE_SEGMENT_BYTES = 1 << 30
FLUSH_TIMEOUT_S = 120.0


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of `length` token ids drawn uniformly from [1000, vocab_size)
    (clear of the special tokens at the start of the vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab_size) for _ in range(length)] for _ in range(count)]


@contextlib.contextmanager
def tier_spec(tier: str, work_dir: str) -> Iterator[dict[str, str | float]]:
    """The tier's spec for `kv_connector_extra_config["tiers"]`, with its server (redis,
    mooncake) running for the duration of the block.

    Raises:
        RuntimeError: the server's binary or package is missing or it did not start (the
            message says what to install).
    """
    if tier == "dram":
        yield {"name": "dram", "capacity_bytes": DRAM_CAPACITY_BYTES}
    elif tier == "disk":
        yield {"name": "disk", "path": f"{work_dir}/disk", "capacity_bytes": DISK_CAPACITY_BYTES}
    elif tier in ("redis", "mooncake"):
        try:
            from pdkv.launch import services
        except ImportError as e:
            raise RuntimeError(f"this checkout has no pool services ({e})") from e
        if tier == "redis":
            with services.start_redis() as svc:
                yield {"name": "redis", "url": svc.address, "timeout_s": 10.0}
        else:
            with services.start_mooncake(segment_bytes=MOONCAKE_SEGMENT_BYTES) as svc:
                yield {"name": "mooncake", "master": svc.address}
    else:
        raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")


class _Engine:
    """An in-process LLM and the timing of one prompt at a time on it."""

    def __init__(self, model: str, block_size: int, prompt_len: int, max_tokens: int,
                 kv_transfer_config: str | None) -> None:
        from pdkv import LLM, SamplingParams

        max_len = prompt_len + max_tokens + block_size
        blocks = 2 * (-(-max_len // block_size)) + 8  # two requests' worth: one prompt at a time
        self.llm = LLM(model, block_size=block_size, num_kv_blocks=blocks, max_model_len=max_len,
                       kv_transfer_config=kv_transfer_config)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run(self, prompt: list[int]) -> tuple[float, list[int], int]:
        """(TTFT in s, output token ids, prompt tokens served from a cache) of one prompt."""
        out = self.llm.generate([{"prompt_token_ids": prompt}], self.params, use_tqdm=False)[0]
        assert out.metrics is not None and out.metrics.ttft is not None
        return out.metrics.ttft, list(out.outputs[0].token_ids), out.num_cached_tokens

    def reset_local(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused: blocks still in use")

    def shutdown(self) -> None:
        self.llm.llm_engine.shutdown()


def _pool_config(spec: Mapping[str, object], chunk_size: int) -> str:
    return json.dumps({"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"chunk_size": chunk_size, "tiers": [spec]}})


def _cold_hot(eng: _Engine, tier: str, prompt: list[int]) -> tuple[ColdHot, list[int], list[int]]:
    """Cold run, flush the pool's save queue, reset the engine's prefix cache, hot run; the hot
    run's pool bytes read and summed get seconds come from the scheduler's counters and
    histogram samples (drained just before it)."""
    sched = eng.llm.llm_engine.scheduler
    store = eng.llm.llm_engine.runner.connector.store  # type: ignore[union-attr]
    cold_s, cold_tokens, cold_cached = eng.run(prompt)
    if not store.flush(FLUSH_TIMEOUT_S):
        raise RuntimeError(f"{tier}: save queue not flushed in {FLUSH_TIMEOUT_S:g} s")
    eng.reset_local()
    sched.stats()  # drain histogram samples of the cold run
    read_before = sched.kv_stats.get(f"pool:{tier}:bytes_read", 0.0)
    hot_s, hot_tokens, hit = eng.run(prompt)
    observations = sched.stats().kv_observations or {}
    load_s = sum(observations.get(f"pool:{tier}:load_seconds", []))
    return ({"cold_ttft_s": cold_s, "hot_ttft_s": hot_s, "cold_cached_tokens": cold_cached,
             "hit_tokens": hit,
             "bytes_read": sched.kv_stats.get(f"pool:{tier}:bytes_read", 0.0) - read_before,
             "load_s": load_s}, cold_tokens, hot_tokens)


def run_pool_bench(
    tiers: Sequence[str] = ("dram", "disk"),
    chunk_size: int = 256,
    prompt_len: int = 2049,
    repeats: int = 3,
    max_tokens: int = 8,
    seed: int = 0,
    model: str = "smollm2",
    block_size: int = 16,
    work_dir: str | None = None,
    verbose: bool = True,
) -> PoolResult:
    """Cold vs hot TTFT per pool tier, with the no-pool engine's TTFT as the peer.

    Each engine first runs one untimed warm-up prompt (2 chunks + 1 tokens, cold then hot).
    Then for each of `repeats` distinct random-token prompts of `prompt_len` tokens: TTFT the
    first time the prompt is seen (cold), then after the pool's save queue is flushed and the
    engine's prefix cache reset, TTFT of the same prompt again (hot: served by the pool). Greedy
    outputs of `max_tokens` tokens are compared across no-pool, cold and hot.

    Args:
        tiers: tier names, each measured with a pool of that single tier; redis and mooncake
            start their server for the run and are skipped (reason in the result) when it
            cannot start.
        chunk_size: pool chunk in tokens (a multiple of block_size).
        prompt_len: prompt tokens (a full hit is ((n-1)//C)*C tokens).
        repeats: prompts per tier (medians are reported).
        max_tokens: output tokens per request.
        seed: seed of the random prompts.
        model: model alias or folder.
        block_size: tokens per KV block.
        work_dir: where the disk tier writes; None = a temporary directory removed afterwards.
        verbose: print one line per measurement and the final table.

    Returns:
        A JSON-able dict: settings, expected_hit_tokens, no_pool_ttft_ms (median),
        tiers {name: summary (see `summarize_tier`) plus samples, or {"skipped": reason}} and
        ok (every measured tier hit fully and stayed token-identical).

    Raises:
        ValueError: an unknown tier, chunk_size not a positive multiple of block_size, or
            prompt_len / repeats not positive.
    """
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        raise ValueError(f"unknown tiers {bad}; known: {', '.join(TIERS)}")
    if chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(
            f"chunk_size {chunk_size} must be a positive multiple of the block size {block_size}"
        )
    if prompt_len <= 0 or repeats <= 0:
        raise ValueError("prompt_len and repeats must be positive")
    say = print if verbose else (lambda *a, **k: None)
    expected = max_loadable_tokens(prompt_len, chunk_size)
    result: PoolResult = {
        "model": model,
        "block_size": block_size,
        "chunk_size": chunk_size,
        "prompt_len": prompt_len,
        "repeats": repeats,
        "max_tokens": max_tokens,
        "seed": seed,
        "expected_hit_tokens": expected,
        "tiers": {},
    }
    own_dir = work_dir is None
    work = tempfile.mkdtemp(prefix="pdkv-bench-pool-") if work_dir is None else work_dir
    try:
        plain = _Engine(model, block_size, prompt_len, max_tokens, None)
        engine = plain.llm.llm_engine
        vocab = min(engine.vocab_size, engine.tokenizer.vocab_size)
        warm, *prompts = random_prompts(repeats + 1, prompt_len, vocab, seed)
        warm = warm[: min(prompt_len, 2 * chunk_size + 1)]
        plain.run(warm)
        reference: list[list[int]] = []
        ttfts: list[float] = []
        for i, p in enumerate(prompts):
            plain.reset_local()
            ttft, tokens, _ = plain.run(p)
            ttfts.append(ttft)
            reference.append(tokens)
            say(f"no pool  repeat {i}: TTFT {ttft * 1000:.0f} ms", flush=True)
        plain.shutdown()
        result["no_pool_ttft_ms"] = 1000 * statistics.median(ttfts)
        result["no_pool_ttft_s"] = ttfts
        for tier in tiers:
            try:
                result["tiers"][tier] = _run_tier(
                    tier,
                    work,
                    model,
                    block_size,
                    chunk_size,
                    prompt_len,
                    max_tokens,
                    warm,
                    prompts,
                    reference,
                    expected,
                    say,
                )
            except RuntimeError as e:
                say(f"{tier}: skipped: {e}", flush=True)
                result["tiers"][tier] = {"skipped": str(e)}
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
    measured = [r for r in result["tiers"].values() if "skipped" not in r]
    result["ok"] = all(r["hits_ok"] and r["identical"] for r in measured)
    if verbose:
        print()
        print(format_table(result), flush=True)
    return result


def _run_tier(
    tier: str,
    work: str,
    model: str,
    block_size: int,
    chunk_size: int,
    prompt_len: int,
    max_tokens: int,
    warm: list[int],
    prompts: list[list[int]],
    reference: list[list[int]],
    expected: int,
    say: Callable[..., object],
) -> TierSummary:
    with tier_spec(tier, work) as spec:
        eng = _Engine(model, block_size, prompt_len, max_tokens, _pool_config(spec, chunk_size))
        try:
            _cold_hot(eng, tier, warm)
            samples: list[PoolSample] = []
            for i, (p, ref) in enumerate(zip(prompts, reference)):
                t0 = time.perf_counter()
                m, cold_tokens, hot_tokens = _cold_hot(eng, tier, p)
                s: PoolSample = {**m, "identical": cold_tokens == hot_tokens == ref}
                samples.append(s)
                say(
                    f"{tier:<8} repeat {i}: cold {s['cold_ttft_s'] * 1000:.0f} ms, hot "
                    f"{s['hot_ttft_s'] * 1000:.0f} ms, hit {s['hit_tokens']}/{expected} tokens, "
                    f"{s['bytes_read'] / 1e6:.0f} MB read in {s['load_s'] * 1000:.0f} ms, "
                    f"identical {s['identical']} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
        finally:
            eng.shutdown()
    summary = summarize_tier(tier, samples, expected)
    summary["samples"] = samples
    return summary
