"""The settings of one `pdkv bench serve` run (`BenchConfig`) and the datasets it knows."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdkv.bench.serve.client import ENDPOINT_PATHS

DATASETS = ("random", "prefix-repetition", "multi-turn", "jsonl", "sharegpt")


@dataclass
class BenchConfig:
    """Settings of one `pdkv bench serve` run (lengths in tokens, rates in req/s, SLOs in ms)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"
    model: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 4
    num_turns: int = 4
    system_prompt_len: int = 0
    """multi-turn: tokens of the system message each conversation opens with (0: none)."""
    num_system_prompts: int = 1
    """multi-turn: distinct system prompts; conversation c gets prompt c % num_system_prompts."""
    vocab_size: int = 49152
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    api_key: str | None = None
    metrics_url: str | None = None
    scrape_metrics: bool = True
    disable_tqdm: bool = False
    ignore_eos: bool = True
    request_timeout: float = 6 * 3600.0
    tokenizer: str | None = None
    """Local tokenizer (alias, HF id, folder) used when the server has no /tokenize (None: the
    model name)."""
    sharegpt_output_len: int | None = None

    def __post_init__(self) -> None:
        """Validate the settings that would otherwise fail late."""
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}: use one of {DATASETS}")
        if self.dataset in ("jsonl", "sharegpt") and not self.dataset_path:
            raise ValueError(f"--dataset {self.dataset} needs --dataset-path FILE")
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}")
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (or inf)")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        if self.num_turns < 1:
            raise ValueError("--num-turns must be >= 1")
        if self.system_prompt_len < 0 or self.num_system_prompts < 1:
            raise ValueError("--system-prompt-len must be >= 0 and --num-system-prompts >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        self.base_url = self.base_url.rstrip("/")

    @property
    def api_url(self) -> str:
        """The full URL requests are POSTed to."""
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    @property
    def metrics_urls(self) -> list[str] | None:
        """The Prometheus URLs given (`metrics_url`, comma-separated), None when not given (then
        BASE_URL/metrics and, behind a pdkv proxy, its engines': server_metrics.metrics_targets)."""
        if not self.metrics_url:
            return None
        return [u.strip() for u in self.metrics_url.split(",") if u.strip()]
