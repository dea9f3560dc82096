"""The benchmark loop of `pdkv bench serve`: build prompts, dispatch them, gather timings.

Flow (as in vLLM's `benchmarks/serve.py::benchmark`): resolve the model (`/v1/models` when
not given), pick the tokenizer (server `/tokenize` or the word fallback), build the dataset,
scrape the server's Prometheus counters, dispatch the requests at the configured arrival times
under an optional concurrency semaphore, scrape again, and compute the metrics.

Arrivals: with `request_rate` = inf every request is dispatched at once; otherwise the gaps
are Gamma(shape=burstiness, scale=1 / (rate * burstiness)) draws (exponential, i.e. a Poisson
process, for burstiness 1) from a generator seeded with `seed`, accumulated and rescaled so
the last arrival is at num_prompts / rate seconds (vLLM's normalization). The duration runs
from the first dispatch to the last completion; E2EL excludes the time a request waited for
the semaphore (reported separately as queue time).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from pdkv.bench.serve import datasets
from pdkv.bench.serve.client import auth_headers, send_request
from pdkv.bench.serve.config import BenchConfig
from pdkv.bench.serve.local_tokenizer import load_local_tokenizer_async
from pdkv.bench.serve.metrics import compute_metrics
from pdkv.bench.serve.records import RequestResult, SampleRequest
from pdkv.bench.serve.report import build_result
from pdkv.bench.serve.server_metrics import combine_deltas, metrics_targets, scrape_all
from pdkv.bench.serve.sharegpt import sharegpt_dataset
from pdkv.keepalive import client_limits


def arrival_times(n: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Dispatch offsets in seconds from the benchmark start for n requests (see module doc)."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])  # its own stream: independent of the dataset draws
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    cum = np.cumsum(gaps)
    if cum[-1] > 0:
        cum *= (n / request_rate) / cum[-1]
    return [float(t) for t in cum]


async def first_model(client: httpx.AsyncClient, base_url: str,
                      headers: dict[str, str] | None = None) -> str:
    """The id of the first model the server lists at `/v1/models`."""
    try:
        r = await client.get(f"{base_url}/v1/models", headers=headers)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(
            f"--model not given and {base_url}/v1/models gave no model ({e}); "
            "is the server up at --base-url?"
        ) from e


async def build_dataset(cfg: BenchConfig, tok: datasets.PromptTokenizer) -> list[SampleRequest]:
    """The prompts `cfg.dataset` asks for, measured with `tok`."""
    if cfg.dataset == "random":
        return await datasets.random_dataset(tok, cfg.num_prompts, cfg.input_len, cfg.output_len,
                                             cfg.range_ratio, cfg.vocab_size, cfg.seed)
    if cfg.dataset == "multi-turn":  # --num-prompts conversations of --num-turns turns
        return await datasets.multi_turn_dataset(
            tok, cfg.num_prompts, cfg.num_turns, cfg.input_len, cfg.output_len, cfg.vocab_size,
            cfg.seed, prefix_len=cfg.system_prompt_len, num_prefixes=cfg.num_system_prompts)
    if cfg.dataset == "prefix-repetition":
        return await datasets.prefix_repetition_dataset(
            tok, cfg.num_prompts, cfg.prefix_len, cfg.input_len, cfg.output_len,
            cfg.num_prefixes, cfg.range_ratio, cfg.vocab_size, cfg.seed)
    assert cfg.dataset_path is not None
    if cfg.dataset == "sharegpt":
        return await sharegpt_dataset(
            tok, cfg.dataset_path, cfg.num_prompts, cfg.seed, cfg.sharegpt_output_len
        )
    return await datasets.jsonl_dataset(tok, cfg.dataset_path, cfg.num_prompts, cfg.output_len)


async def dispatch(client: httpx.AsyncClient, cfg: BenchConfig, model: str,
                   samples: list[SampleRequest],
                   headers: dict[str, str]) -> tuple[list[RequestResult], float]:
    """Send every sample at its arrival time, bounded by `cfg.max_concurrency`.

    Returns:
        (results in sample order with start_time relative to the benchmark start in s,
        duration in s from the first dispatch to the last completion).
    """
    times = arrival_times(len(samples), cfg.request_rate, cfg.seed, cfg.burstiness)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    pbar = tqdm(total=len(samples), disable=cfg.disable_tqdm)

    async def _one(sample: SampleRequest) -> RequestResult:
        arrived = time.perf_counter()
        if sem is None:
            res = await send_request(client, cfg.api_url, cfg.endpoint, model, sample,
                                     headers, cfg.ignore_eos)
        else:
            async with sem:
                res = await send_request(client, cfg.api_url, cfg.endpoint, model, sample,
                                         headers, cfg.ignore_eos)
        res.queue_time = res.start_time - arrived
        pbar.update(1)
        return res

    start = time.perf_counter()
    tasks = []
    for sample, offset in zip(samples, times):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(sample)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    pbar.close()
    for r in results:
        r.start_time -= start
    return results, duration


async def run_benchmark(cfg: BenchConfig, log: Callable[[str], object] = print) -> dict[str, Any]:
    """Run the whole benchmark against `cfg.base_url`; returns the result dict (see report)."""
    headers = auth_headers(cfg.api_key)
    timeout = httpx.Timeout(cfg.request_timeout, connect=60.0)
    limits = client_limits(None)  # drops idle connections before the server does
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = cfg.model or await first_model(client, cfg.base_url, headers)
        tok = await pick_tokenizer(client, cfg, model, headers, log)
        try:
            samples = await build_dataset(cfg, tok)
        except httpx.HTTPStatusError as e:
            raise RuntimeError(
                f"building prompts with the server tokenizer failed ({e}); is --vocab-size "
                f"({cfg.vocab_size}) larger than the model's vocabulary?") from e
        urls: list[str] = []
        if cfg.scrape_metrics:
            urls = cfg.metrics_urls or await metrics_targets(client, cfg.base_url, headers)
        before = await scrape_all(client, urls, headers)
        log(f"Traffic request rate: {cfg.request_rate}")
        log(f"Burstiness factor: {cfg.burstiness}"
            f" ({'Poisson process' if cfg.burstiness == 1.0 else 'Gamma distribution'})")
        log(f"Maximum request concurrency: {cfg.max_concurrency}")
        results, duration = await dispatch(client, cfg, model, samples, headers)
        after = await scrape_all(client, urls, headers)
    metrics = compute_metrics(results, duration, cfg.percentiles, cfg.goodput)
    return build_result(cfg, model, tok.name, metrics, results,
                        combine_deltas(before, after) if urls else None)


async def pick_tokenizer(client: httpx.AsyncClient, cfg: BenchConfig, model: str,
                         headers: dict[str, str],
                         log: Callable[[str], object]) -> datasets.PromptTokenizer:
    """The server's tokenizer (/tokenize + /detokenize); without them the model's own loaded
    locally (`cfg.tokenizer`, else the model name: an alias, HF id in the local cache or
    folder); failing that, one word per token (with a warning)."""
    tok = await datasets.server_tokenizer_or_words(client, cfg.base_url, model, headers)
    if tok.name == "server":
        return tok
    name = cfg.tokenizer or model
    try:
        local = await load_local_tokenizer_async(name)
    except (ValueError, OSError) as e:
        log(f"WARNING: the server has no /tokenize and no local tokenizer for {name!r} ({e}); "
            "prompt lengths are counted in words (give --tokenizer)")
        return tok
    log(
        f"the server has no /tokenize; counting tokens with the tokenizer of {name!r} "
        f"({local.source})"
    )
    return local


def run_serve_bench(cfg: BenchConfig, log: Callable[[str], object] = print) -> dict[str, Any]:
    """Synchronous wrapper of `run_benchmark` (starts its own event loop)."""
    return asyncio.run(run_benchmark(cfg, log))
