"""One-shot GPU check (issue 14): greedy parity with HF transformers on the device, then decode
tokens/s of pdkv (CUDA graphs, and --enforce-eager) vs HF on the same device.

Run by scripts/gpu_check.sh (which also runs the CUDA-only unit tests). Sizes are small so the
whole check takes a few minutes on any CUDA GPU; `--device cpu` runs the same steps on the CPU
(a smoke test of this script, with the sizes given).

Decode tokens/s = batch x (output_len - 1) / (time for output_len tokens - time for 1 token):
the difference removes the prefill, so it is the decode steps' rate (aggregate over the batch).
Prompts are random ids of one length (no padding in HF's batch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=gen).tolist()


def pdkv_run(llm, prompts: list[list[int]], n: int, device: str) -> tuple[list[list[int]], float]:
    """(greedy outputs, seconds) of one pdkv generate call."""
    from pdkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync(device)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def hf_run(model, prompts: list[list[int]], n: int, device: str) -> tuple[list[list[int]], float]:
    """(greedy outputs, seconds) of one HF generate call over the whole batch."""
    ids = torch.tensor(prompts, device=device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    _sync(device)
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - t0


def decode_rate(run, batch: int, out_len: int) -> float:
    """Aggregate decode tokens/s (see the module docstring); the best of two timings each."""
    t_full = min(run(out_len)[1] for _ in range(2))
    t_one = min(run(1)[1] for _ in range(2))
    return batch * (out_len - 1) / max(t_full - t_one, 1e-9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parity-prompts", type=int, default=4)
    p.add_argument("--parity-tokens", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=65)
    p.add_argument("--batches", default="1,32", help="decode batch sizes measured")
    p.add_argument("--result-json", default=None)
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: nothing checked", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM

    from pdkv import LLM
    from pdkv.model.registry import resolve_model

    path = resolve_model(a.model)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity: no TF32 in either system
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(a.device).eval()
    vocab = hf.config.vocab_size
    batches = [int(b) for b in a.batches.split(",")]
    common = {
        "device": a.device,
        "max_model_len": a.input_len + max(a.output_len, a.parity_tokens) + 16,
        "max_num_seqs": max(batches + [a.parity_prompts]),
        "num_kv_blocks": 2048,
        "enable_prefix_caching": False,
    }  # every timed run prefills, as HF does
    engines = {"pdkv": LLM(path, **common), "pdkv_eager": LLM(path, enforce_eager=True, **common)}
    graphs = engines["pdkv"].llm_engine.runner.decode_graphs
    result: dict = {
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "model": a.model,
        "cuda_graphs": graphs is not None,
        "torch": torch.__version__,
    }
    prompts = _prompts(a.parity_prompts, a.input_len, vocab, seed=1)
    ref, _ = hf_run(hf, prompts, a.parity_tokens, a.device)
    for name, llm in engines.items():
        got, _ = pdkv_run(llm, prompts, a.parity_tokens, a.device)
        same = sum(g == r for g, r in zip(got, ref))
        result[f"parity_{name}"] = f"{same}/{len(ref)}"
        print(f"greedy parity {name} vs HF on {a.device}: {same}/{len(ref)} prompts identical "
              f"({a.parity_tokens} tokens)")
    for b in batches:
        ps = _prompts(b, a.input_len, vocab, seed=2 + b)
        rates = {
            name: decode_rate(
                lambda n, llm=llm, ps=ps: pdkv_run(llm, ps, n, a.device), b, a.output_len
            )
            for name, llm in engines.items()
        }
        rates["hf"] = decode_rate(lambda n, ps=ps: hf_run(hf, ps, n, a.device), b, a.output_len)
        result[f"decode_tok_s_batch{b}"] = {k: round(v, 1) for k, v in rates.items()}
        print(f"decode tok/s, batch {b}: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
              + f"; pdkv/HF {rates['pdkv'] / rates['hf']:.2f}x")
    if graphs is not None:
        result["captured_sizes"] = sorted(graphs.graphs)
    print(json.dumps(result))
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(result, f, indent=1)
    parity_ok = all(
        result[f"parity_{n}"].split("/")[0] == result[f"parity_{n}"].split("/")[1] for n in engines
    )
    return 0 if parity_ok else 1


if __name__ == "__main__":
    sys.exit(main())
