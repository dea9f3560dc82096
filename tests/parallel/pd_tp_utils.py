"""In-process P (tp 1, or a multi-process P) and a D over the P2P connector (tcp), stepped by hand:
shared by the P/D into DCP and the P/D re-sharding tests."""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from pdkv import LLM, SamplingParams

BLOCK = 16
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def kv_config(role: str, **extra: Any) -> str:
    return json.dumps({"kv_connector": "P2PConnector", "kv_role": role,
                       "kv_connector_extra_config": {"transfer": "tcp", **extra}})


def engine(model: str, **kw: Any) -> LLM:
    return LLM(
        model, cpu_linear="torch", block_size=BLOCK, num_kv_blocks=48, max_model_len=256, **kw
    )


def step_until(engines: list[LLM], done: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "engines did not reach the expected state"
        for e in engines:
            e.llm_engine.step()
        time.sleep(0.001)


def prefill(p: LLM, prompt: list[int], tp: int = 1) -> tuple[dict[str, Any], int]:
    """P's leg (max_tokens 1, do_remote_decode) on a P at `tp`: (kv_transfer_params, P's cached
    prompt tokens)."""
    eng = p.llm_engine
    req, text = eng.make_request(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=1),
        kv_transfer_params={"do_remote_decode": True},
    )
    eng.add_request(req, text)
    out: list[Any] = []
    step_until([], lambda: out or any(o.finished and out.append(o) for o in eng.step()))
    params = out[0].kv_transfer_params
    assert params is not None and params["tp_size"] == tp and params["dcp_size"] == 1
    assert len(params["endpoints"]) == tp  # one control address per P rank
    return params, out[0].num_cached_tokens


def decode(
    p: LLM, d: LLM, prompt: list[int], params: dict[str, Any]
) -> tuple[Any, list[int], list[Any], int]:
    """D's leg (P is stepped too: it serves the reads): (D's finished output, D's block table,
    each rank's copy of those blocks as torch tensors, D's local prefix-hit tokens). The blocks
    are read once the pull ended and the request runs."""
    eng = d.llm_engine
    req, text = eng.make_request({"prompt_token_ids": prompt}, GREEDY, kv_transfer_params=params)
    eng.add_request(req, text)
    rid = req.request_id
    out: list[Any] = []

    def step() -> bool:
        out.extend(o for o in eng.step() if o.finished and o.request_id == rid)
        p.llm_engine.step()
        return bool(out)

    def pulled() -> bool:
        running = any(r.request_id == rid for r in eng.scheduler.running)
        return step() or (running and req.num_computed_tokens >= len(prompt))

    step_until([], pulled)
    assert not out, (
        f"the request ended before its KV was inspected: {out[0].outputs[0].finish_reason}"
    )
    table = list(eng.scheduler.kv_cache_manager.get_block_ids(rid)[0])
    runner = eng.runner
    shards = (runner.read_kv_blocks(table) if hasattr(runner, "read_kv_blocks")  # a single-rank D:
              else [runner.kv_cache_groups[0][torch.tensor(table)].clone()])  # its own cache
    step_until([], step)
    return out[0], table, shards, req.num_local_hit_tokens
