"""The routing benchmark's figures (pdkv.bench.compare.routing): per-policy results, the issue's
required ratios as a verdict, the time estimate and the printed tables. Pure functions, no I/O.

Required (issue 34, "Goals"): the engine prefix-cache hit rate with kv_aware >= 0.9 x the
oracle's (kv_aware_oracle: the same scoring over each engine's true cached blocks) and >= 1.5 x
round_robin's; the KV index's wrong predictions (over + under, of all it counted) <= 5 %.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol, TypedDict

BENCHMARK_POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware", "kv_aware_oracle")
KV_AWARE, ORACLE, ROUND_ROBIN = "kv_aware", "kv_aware_oracle", "round_robin"
# ChatML (SmolLM2's chat template): "<|im_start|>role\n" + content + "<|im_end|>\n" is 5 tokens
# around the content; the generation cue "<|im_start|>assistant\n" is 3.
CHAT_TOKENS_PER_MESSAGE = 5
CHAT_GENERATION_CUE = 3

Status = Literal["met", "missed", "n/a"]
_ROUNDING = 1e-9  # relative: a ratio this close to its bound meets it (float division)


class WorkloadShape(Protocol):
    """What the estimate reads of a run's settings (pdkv.bench.compare.routing's
    RoutingBenchConfig has these; lengths in tokens, rate in requests/s)."""

    @property
    def policies(self) -> tuple[str, ...]: ...
    @property
    def num_instances(self) -> int: ...
    @property
    def system_prompt_len(self) -> int: ...
    @property
    def turns(self) -> int: ...
    @property
    def input_len(self) -> int: ...
    @property
    def output_len(self) -> int: ...
    @property
    def max_concurrency(self) -> int | None: ...
    @property
    def request_rate(self) -> float: ...
    @property
    def conversations(self) -> int: ...
    @property
    def requests(self) -> int: ...


class PolicyResult(TypedDict):
    """One policy's run (tokens are counts over the workload, deltas of the engines' counters;
    times in ms or s as named). `error` is None for a run that completed; then the figures are
    those of a failed topology (zeros and None)."""

    routing: str
    error: str | None
    requests: int
    completed: int
    failed: int
    ttft_mean_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    duration_s: float | None
    wall_s: float | None
    prompt_tokens: float
    prefix_hits: float
    pool_hits: float
    hit_rate: float | None
    pool_hit_rate: float | None
    preemptions: float
    instances: dict[str, dict[str, float]]
    decisions: dict[str, float]
    predictions: dict[str, float] | None
    wrong_prediction_rate: float | None
    errors: list[str]


@dataclass(frozen=True)
class Targets:
    """The required ratios.

    Attributes:
        min_oracle_share: kv_aware's hit rate / the oracle's, at least.
        min_round_robin_factor: kv_aware's hit rate / round_robin's, at least.
        max_wrong_prediction_rate: kv_aware's wrong predictions / all its predictions, at most.
    """

    min_oracle_share: float = 0.9
    min_round_robin_factor: float = 1.5
    max_wrong_prediction_rate: float = 0.05


@dataclass(frozen=True)
class TimingModel:
    """What the time estimate assumes (SmolLM2-135M on 2 cores, fp32, measured on the
    development box: ~600 prompt tokens/s of prefill with 2 threads, ~30 ms per decode step).

    Attributes:
        prefill_tok_s: prefill tokens per second of the whole machine.
        decode_step_s: seconds per decode step of one engine.
        startup_s: seconds per policy for starting the topology (engines load the model), building
            the prompts through it and stopping it.
    """

    prefill_tok_s: float = 600.0
    decode_step_s: float = 0.03
    startup_s: float = 45.0


@dataclass(frozen=True)
class Check:
    """One verdict line.

    Attributes:
        name: what is required, e.g. "kv_aware hit rate >= 0.9 x kv_aware_oracle's".
        status: "met", "missed", or "n/a" (a policy it needs was not run or failed).
        value: the measured ratio or rate (None when n/a; inf when divided by zero).
        target: the bound it is held to.
        text: the numbers it was judged on.
    """

    name: str
    status: Status
    value: float | None
    target: float
    text: str


def policy_hit_rate(hits: float, prompt_tokens: float) -> float | None:
    """hits / prompt tokens; None without prompt tokens."""
    return hits / prompt_tokens if prompt_tokens > 0 else None


def workload_prompt_tokens(cfg: WorkloadShape) -> int:
    """Prompt tokens of one policy's workload as the chat template counts them (every turn's
    full prompt, no cache): turn t = system message + t x (question + answer) + question + cue."""
    system = cfg.system_prompt_len + CHAT_TOKENS_PER_MESSAGE if cfg.system_prompt_len else 0
    turn = cfg.input_len + cfg.output_len + 2 * CHAT_TOKENS_PER_MESSAGE
    per_conv = sum(system + t * turn + cfg.input_len + CHAT_TOKENS_PER_MESSAGE
                   + CHAT_GENERATION_CUE for t in range(cfg.turns))
    return per_conv * cfg.conversations


def estimate_seconds(cfg: WorkloadShape, timing: TimingModel, cpus: int) -> float:
    """An upper bound of the whole run in seconds: per policy, the start-up plus every prompt
    token prefilled (no prefix hit: round_robin's case) and every output token decoded, decode
    steps of up to min(max concurrency, instances, cpus) engines overlapping; an open loop
    (finite request rate) lasts at least requests / rate."""
    parallel = max(1, min(cfg.max_concurrency or cfg.requests, cfg.num_instances, cpus))
    compute = (workload_prompt_tokens(cfg) / timing.prefill_tok_s
               + cfg.requests * cfg.output_len * timing.decode_step_s / parallel)
    if math.isfinite(cfg.request_rate):
        compute = max(compute, cfg.requests / cfg.request_rate)
    return len(cfg.policies) * (timing.startup_s + compute)


def _by_name(results: list[PolicyResult]) -> dict[str, PolicyResult]:
    return {r["routing"]: r for r in results if r["error"] is None}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else math.nan)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def verdict(results: list[PolicyResult], targets: Targets) -> list[Check]:
    """The issue's three required ratios, judged on `results` (policies that failed count as not
    run). A zero hit rate never meets a ratio (0 >= 1.5 x 0 proves nothing); the bounds are
    inclusive."""
    got = _by_name(results)
    kv = got.get(KV_AWARE)
    kv_rate = kv["hit_rate"] if kv else None
    checks = []
    for other, bound, name in (
        (ORACLE, targets.min_oracle_share,
         f"kv_aware hit rate >= {targets.min_oracle_share:g} x kv_aware_oracle's"),
        (ROUND_ROBIN, targets.min_round_robin_factor,
         f"kv_aware hit rate >= {targets.min_round_robin_factor:g} x round_robin's"),
    ):
        ref = got.get(other)
        ref_rate = ref["hit_rate"] if ref else None
        if kv_rate is None or ref_rate is None:
            missing = KV_AWARE if kv_rate is None else other
            checks.append(Check(name, "n/a", None, bound, f"no hit rate for {missing}"))
            continue
        ratio = _ratio(kv_rate, ref_rate)
        met = ratio >= bound * (1 - _ROUNDING)  # 0 / 0 is nan: never met
        checks.append(Check(name, "met" if met else "missed", ratio, bound,
                            f"{kv_rate:.3f} / {ref_rate:.3f} = {ratio:.2f}"))
    name = f"kv_aware wrong predictions <= {targets.max_wrong_prediction_rate:.0%}"
    rate = kv["wrong_prediction_rate"] if kv else None
    if kv is None or rate is None or not kv["predictions"]:
        checks.append(Check(name, "n/a", None, targets.max_wrong_prediction_rate,
                            "no kv_aware run" if kv is None else "the proxy counted no prediction"))
    else:
        p = kv["predictions"]
        wrong = p.get("over", 0.0) + p.get("under", 0.0)
        met = rate <= targets.max_wrong_prediction_rate * (1 + _ROUNDING)
        checks.append(Check(name, "met" if met else "missed", rate,
                            targets.max_wrong_prediction_rate,
                            f"{wrong:.0f} wrong (over {p.get('over', 0.0):.0f}, under "
                            f"{p.get('under', 0.0):.0f}) of {sum(p.values()):.0f} = {rate:.1%}"))
    return checks


def format_report(result: dict[str, object]) -> str:
    """Plain-text tables of a `routing.run_benchmark` result: one row per policy, then one per
    policy and instance, the machine and the estimated vs the actual time."""
    policies: list[PolicyResult] = result["policies"]  # type: ignore[assignment]
    lines = [f"{'routing':<16}{'done':>9}{'hit rate':>9}{'prompt tok':>11}{'hit tok':>9}"
             f"{'TTFT mean':>10}{'TTFT p99':>10}{'preempt':>8}{'wrong pred':>11}  decisions"]
    for r in policies:
        if r["error"] is not None:
            why = [ln for ln in r["error"].splitlines() if ln.strip()] or ["?"]
            lines.append(f"{r['routing']:<16}failed: {why[-1]}")  # the launcher's last word
            continue
        wrong = r["wrong_prediction_rate"]
        decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["decisions"].items()))
        lines.append(
            f"{r['routing']:<16}{r['completed']:>4}/{r['requests']:<4}{_fmt(r['hit_rate']):>9}"
            f"{r['prompt_tokens']:>11.0f}{r['prefix_hits']:>9.0f}"
            f"{r['ttft_mean_ms'] or 0:>8.0f}ms{r['ttft_p99_ms'] or 0:>8.0f}ms"
            f"{r['preemptions']:>8.0f}{'-' if wrong is None else f'{wrong:.1%}':>11}  {decisions}")
    lines.append("")
    lines.append(f"{'routing':<16}{'instance':<10}{'requests':>9}{'prompt tok':>11}"
                 f"{'hit tok':>9}{'hit rate':>9}{'pool hit':>9}")
    for r in policies:
        for name, p in r["instances"].items():
            rate = policy_hit_rate(p["prefix_hits"], p["prompt_tokens"])
            lines.append(f"{r['routing']:<16}{name:<10}{p['requests']:>9.0f}"
                         f"{p['prompt_tokens']:>11.0f}{p['prefix_hits']:>9.0f}{_fmt(rate):>9}"
                         f"{p['pool_hits']:>9.0f}")
    m: dict[str, str] = result["machine"]  # type: ignore[assignment]
    flags = m.get("flags") or "no AVX-512 / AMX"
    estimated = float(result["estimated_s"])  # type: ignore[arg-type]
    elapsed = float(result["elapsed_s"])  # type: ignore[arg-type]
    lines += ["", f"machine: {m.get('cpu')} ({m.get('cores')} cores; {flags}), commit "
              f"{m.get('commit')}, load average {m.get('load_average_before')} before, "
              f"{m.get('load_average_after')} after",
              f"time: estimated at most {estimated / 60:.1f} min (upper bound), took "
              f"{elapsed / 60:.1f} min"]
    return "\n".join(lines)


def format_verdict(result: dict[str, object]) -> str:
    """The verdict block: one line per required ratio, "met" / "missed" / "n/a" with numbers."""
    lines = ["verdict:"]
    for c in result["verdict"]:  # type: ignore[attr-defined]
        lines.append(f"  {c['status']:<7}{c['name']}: {c['text']}")
    return "\n".join(lines)
