"""Real chat prompts through a running topology: answers, TTFT, TPOT and KV bytes moved."""

from __future__ import annotations

import json
import time

import httpx

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Give three tips for learning a new language.",
]


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def chat_stream(
    endpoint: str, model: str, prompt: str, max_tokens: int = 64
) -> dict[str, float | str | int]:
    """One streamed chat request; client-side TTFT/TPOT (s) and usage."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    text, usage = "", {}
    with httpx.stream("POST", endpoint + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += piece
    n = int(usage.get("completion_tokens", 0))
    ttft = (first - t0) if first else float("nan")
    tpot = ((last - first) / (n - 1)) if first and last and n > 1 else float("nan")
    return {
        "text": text,
        "ttft": ttft,
        "tpot": tpot,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "completion_tokens": n,
    }


def run_demo(endpoint: str, decode_urls: list[str], model: str) -> None:
    """Send DEMO_PROMPTS one by one to `endpoint` (the proxy or an engine) and print what came
    back, with the KV bytes the decode engines at `decode_urls` received for each (P/D)."""
    for prompt in DEMO_PROMPTS:
        before = sum(_metric(u, "pdkv:kv_transfer_bytes_received_total") for u in decode_urls)
        r = chat_stream(endpoint, model, prompt)
        after = sum(_metric(u, "pdkv:kv_transfer_bytes_received_total") for u in decode_urls)
        print(f"\n=== {prompt}\n{r['text']}")
        line = (f"--- prompt {r['prompt_tokens']} tok, output {r['completion_tokens']} tok, "
                f"TTFT {float(r['ttft']) * 1000:.0f} ms, TPOT {float(r['tpot']) * 1000:.0f} ms")
        if decode_urls:
            line += f", KV moved P->D {after - before:,.0f} B"
        print(line, flush=True)
