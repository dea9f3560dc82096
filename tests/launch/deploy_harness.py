"""`pdkv up --deploy FILE` as a test drives it: the launcher in its own session with its output
in a file, the URLs it prints, the engines' Prometheus metrics and a greedy completion through
the proxy, the KV formula (shared by tests/launch/test_deploy_up.py, test_link_faults.py and
test_deploy_mooncake.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MAX_TOKENS = 8
BS = 16  # the engines' block size (default)


def kv_bytes(model_dir: str, num_tokens: int) -> int:
    """KV bytes D pulls for a prompt of `num_tokens`: every block P computed, whole (D
    recomputes the last token, but the block holding it is pulled with the rest; as
    tests/kv_transfer/test_pd_mla.py), each block = block size x layers x 2 (K and V) x KV
    heads x head size x 4 bytes (float32)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head * 4
    return -(-num_tokens // BS) * BS * per_token


class Up:
    """`pdkv up --deploy FILE [flags]` as a process in its own session; its output in a file."""

    def __init__(self, tmp_path: Path, cache: str, *flags: str, deploy: str) -> None:
        self.out = tmp_path / "up.out"
        cmd = [sys.executable, "-m", "pdkv.cli", "up", "--deploy", deploy, "--log-dir",
               str(tmp_path / "logs"), "--health-timeout", "60", *flags]
        env = dict(os.environ, PDKV_CACHE=cache)
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=ROOT)

    def text(self) -> str:
        return self.out.read_text()

    def wait_for(self, pattern: str, timeout: float = 90.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.text(), re.M)
            if m:
                return m
            assert self.proc.poll() is None, f"pdkv up exited:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {pattern!r} in time:\n{self.text()}"
            time.sleep(0.2)

    def url(self, name: str) -> str:
        return self.wait_for(rf"^  {name}: .*?, (http://[\d.]+:\d+),").group(1)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout)


def metric(url: str, name: str, label: str = "", timeout: float = 10.0) -> float:
    """Sum of the samples of `name` (those whose labels contain `label`, e.g. 'tier="redis"')."""
    text = httpx.get(url + "/metrics", timeout=timeout).text
    pattern = rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M)
               if label in (m.group(1) or ""))


def wait_metric(url: str, name: str, want: float, timeout: float = 20.0) -> float:
    """`name` once it equals `want`, or its last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (got := metric(url, name)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def complete(endpoint: str, prompt: list[int], max_tokens: int = MAX_TOKENS,
             timeout: float = 60.0) -> tuple[str, int]:
    """Greedy (text, completion tokens) of `prompt` through `endpoint`; asserts a 200."""
    r = httpx.post(endpoint + "/v1/completions", timeout=timeout, json={
        "model": "tiny-llama-kv2", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def colocated_answers(model_dir: str, prompts: list[list[int]], num_kv_blocks: int
                      ) -> list[tuple[str, int]]:
    """(text, completion tokens) of a colocated engine's greedy completions of `prompts`
    (MAX_TOKENS each, ignore_eos): the reference a deployment's answers must equal."""
    from pdkv import LLM, SamplingParams

    llm = LLM(model_dir, num_kv_blocks=num_kv_blocks, max_model_len=512)
    try:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.llm_engine.shutdown()
    return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in out]
