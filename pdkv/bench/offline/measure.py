"""Timing of one batch on each system for `pdkv bench offline`: pdkv `LLM.generate` and HF
`generate` (greedy, exactly the requested tokens), best-of-N measurement and throughputs.

Every run returns a `Timed`: its seconds, the token ids, and the seconds until every request had
its first token (the end of the prefill). Decode time is split off inside one run (whole run minus
that first-token time), not as the difference of two runs: with a long batched prefill (64 x 128
tokens take tens of seconds here) the prefill's own run-to-run noise on a shared box is larger
than the whole decode phase, and a difference of two runs inherited it.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pdkv.engine.llm import LLM

Timed = tuple[float, list[list[int]], float]
"""(seconds of the run, output token ids per request, seconds from the start until every request
had its first token)."""

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_pdkv(llm: LLM, prompts: list[list[int]], max_tokens: int, device: str) -> Timed:
    """`llm.generate` of the batch: seconds, each request's output token ids, and the seconds until
    the last request's first token (RequestMetrics.first_token_time, the engine's monotonic
    clock)."""
    from pdkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    gc.collect()
    _sync(device)
    t0 = time.monotonic()
    outs = llm.generate(batch, params, use_tqdm=False)
    _sync(device)
    dt = time.monotonic() - t0
    firsts = [o.metrics.first_token_time for o in outs if o.metrics is not None]
    known = [f for f in firsts if f is not None]
    first = max(known) - t0 if firsts and len(known) == len(firsts) else dt
    return dt, [list(o.outputs[0].token_ids) for o in outs], first


class _FirstStepClock:
    """An HF logits processor that only notes when generate first calls it: right after the
    prefill forward, before the first token is picked."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def run_hf(model: Any, input_ids: torch.Tensor, max_new_tokens: int, device: str) -> Timed:
    """HF `generate` of the batch: seconds, each request's new token ids, and the seconds until its
    first decoding step (the end of the prefill forward)."""
    from transformers import LogitsProcessorList

    attention_mask = torch.ones_like(input_ids)
    clock = _FirstStepClock()
    gc.collect()
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([clock]),
    )
    _sync(device)
    dt = time.perf_counter() - t0
    first = dt if clock.first is None else clock.first - t0
    return dt, out[:, input_ids.shape[1]:].tolist(), first


def _best(fn: Callable[[], Timed], repeats: int) -> tuple[float, list[list[int]], float]:
    """Run `fn` (returning a Timed) `repeats` times: the shortest run, the last outputs, and the
    shortest decode part (run seconds minus first-token seconds)."""
    best = best_decode = math.inf
    toks: list[list[int]] = []
    for _ in range(max(1, repeats)):
        dt, toks, first = fn()
        best = min(best, dt)
        best_decode = min(best_decode, dt - first)
    return best, toks, best_decode


def measure(run: Callable[[int], Timed], output_len: int, repeats: int,
            max_extra: int = 3) -> tuple[float, float | None, list[list[int]], int]:
    """Best-of-`repeats` prefill seconds (a 1-token run) and prefill + decode seconds, and the
    output tokens.

    `run(max_tokens)` returns a Timed. The decode part is taken inside each `output_len` run (its
    seconds after every request's first token; module docstring); total = best prefill + best
    decode part. A decode part that is not positive (a clock with too coarse a tick) is measured
    again, at most `max_extra` times.

    Returns:
        (prefill seconds, total seconds or None when output_len < 2, tokens, extra runs).
    """
    pre, toks, _ = _best(lambda: run(1), repeats)
    if output_len < 2:
        return pre, None, toks, 0
    _, toks, decode = _best(lambda: run(output_len), repeats)
    extra = 0
    while decode <= 0 and extra < max_extra:
        extra += 1
        dt, toks, first = run(output_len)
        decode = max(decode, dt - first)
    return pre, pre + decode, toks, extra


def throughputs(b: int, input_len: int, output_len: int, prefill_s: float,
                total_s: float | None) -> dict[str, float | None]:
    decode_s = None if total_s is None else total_s - prefill_s
    decode_tok_s = None
    if decode_s is not None and decode_s > 0 and output_len > 1:
        decode_tok_s = b * (output_len - 1) / decode_s
    return {
        "prefill_s": prefill_s,
        "total_s": total_s,
        "decode_s": decode_s,
        "prefill_tok_s": b * input_len / prefill_s,
        "decode_tok_s": decode_tok_s,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def load_hf(path: str, dtype: str, device: str, pad_token_id: int | None) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype]).to(device)
    model.eval()
    gc_ = model.generation_config
    # No EOS: generate exactly max_new_tokens with plain argmax, like pdkv's ignore_eos=True.
    # (min_new_tokens would otherwise mask EOS, which ignore_eos does not.)
    gc_.eos_token_id = None
    gc_.pad_token_id = pad_token_id if pad_token_id is not None else 0
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(gc_, name):
            setattr(gc_, name, None)
    return model
