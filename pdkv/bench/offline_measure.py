"""Timing of one batch on each system for `pdkv bench offline`: pdkv `LLM.generate` and HF
`generate` (greedy, exactly the requested tokens), best-of-N measurement and throughputs."""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import torch

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_pdkv(llm: Any, prompts: list[list[int]], max_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    """Seconds for `llm.generate` of the batch, and each request's output token ids."""
    from pdkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    gc.collect()
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    _sync(device)
    dt = time.perf_counter() - t0
    return dt, [list(o.outputs[0].token_ids) for o in outs]


def run_hf(model: Any, input_ids: torch.Tensor, max_new_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    """Seconds for HF `generate` of the batch, and each request's new token ids."""
    attention_mask = torch.ones_like(input_ids)
    gc.collect()
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    _sync(device)
    dt = time.perf_counter() - t0
    return dt, out[:, input_ids.shape[1]:].tolist()


def _best(fn: Any, repeats: int) -> tuple[float, list[list[int]]]:
    """Run `fn` `repeats` times; the shortest time and the last outputs."""
    best = math.inf
    toks: list[list[int]] = []
    for _ in range(max(1, repeats)):
        dt, toks = fn()
        best = min(best, dt)
    return best, toks


def measure(run: Any, output_len: int, repeats: int, max_extra: int = 3) -> tuple[float, float | None, list[list[int]], int]:
    """Best-of-`repeats` seconds for 1 and for `output_len` tokens, and the output tokens.

    `run(max_tokens)` returns (seconds, token ids per request). When the longer run does not
    take longer than the 1-token run (timing noise, e.g. other processes on the cores), both are
    measured again, at most `max_extra` times, keeping the best of each.

    Returns:
        (prefill seconds, total seconds or None when output_len < 2, tokens, extra pairs run).
    """
    pre, toks = _best(lambda: run(1), repeats)
    if output_len < 2:
        return pre, None, toks, 0
    tot, toks = _best(lambda: run(output_len), repeats)
    extra = 0
    while tot <= pre and extra < max_extra:
        extra += 1
        pre = min(pre, run(1)[0])
        dt, toks = run(output_len)
        tot = min(tot, dt)
    return pre, tot, toks, extra


def throughputs(b: int, input_len: int, output_len: int, prefill_s: float, total_s: float | None) -> dict[str, Any]:
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
