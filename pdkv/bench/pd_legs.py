"""In-process P/D legs for the benchmarks (`pdkv bench hetero`, `pdkv bench groups`): P and D
`LLM` engines wired by the P2P connector and stepped by hand, the proxy's prefill leg, D's decode
leg with what its pull cost, and settling between pulls. Every wait has a deadline
(REQUEST_DEADLINE_S)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from pdkv.jsontypes import JSONObject

if TYPE_CHECKING:
    from pdkv.engine.llm import LLM
    from pdkv.outputs import RequestOutput

NEW_TOKENS = 8  # greedy tokens D decodes (the output check)
REQUEST_DEADLINE_S = 600.0  # one prefill or decode leg, or settling
EXTRA_BLOCKS = 4


def kv_config(role: str, transfer: str) -> str:
    """kv_transfer_config JSON of a P2PConnector engine in `role` over transfer engine
    `transfer`."""
    return json.dumps({"kv_connector": "P2PConnector", "kv_role": role,
                       "kv_connector_extra_config": {"transfer": transfer}})


class Pull(TypedDict):
    """D's decode leg: its greedy output tokens and what its KV pull cost."""

    tokens: list[int]
    bytes: int
    read_ops: int
    transfer_s: float


class PDEngines:
    """The P and D engines of a run, built on first use, keyed by (role, block size, tp)."""

    def __init__(self, path: str, max_len: int, transfer: str, num_threads: int | None) -> None:
        self.path, self.max_len, self.transfer, self.num_threads = (
            path,
            max_len,
            transfer,
            num_threads,
        )
        self.built: dict[tuple[str, int, int], LLM] = {}

    def get(self, role: str, block_size: int, tp: int) -> LLM:
        """The engine of `role` at `block_size` and `tp`, built on first use."""
        from pdkv import LLM

        key = (role, block_size, tp)
        if key not in self.built:
            kw: dict[str, int] = {"tensor_parallel_size": tp} if tp > 1 else {}
            self.built[key] = LLM(
                self.path,
                cpu_linear="torch",
                block_size=block_size,
                max_model_len=self.max_len,
                num_kv_blocks=2 * -(-self.max_len // block_size) + EXTRA_BLOCKS,
                num_threads=self.num_threads,
                kv_transfer_config=kv_config(role, self.transfer),
                **kw,
            )
        return self.built[key]

    def shutdown(self) -> None:
        """Shut down every engine built."""
        for llm in self.built.values():
            llm.llm_engine.shutdown()


def step_until(engines: list[LLM], done: Callable[[], bool], what: str) -> None:
    """Step every engine until `done()`.

    Raises:
        TimeoutError: not done within REQUEST_DEADLINE_S.
    """
    deadline = time.monotonic() + REQUEST_DEADLINE_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not done in {REQUEST_DEADLINE_S:g} s")
        for e in engines:
            e.llm_engine.step()
        time.sleep(0.0005)


def settle(p: LLM, d: LLM) -> None:
    """Step both until neither has open work, then reset D's prefix cache (the next pull is whole).

    Raises:
        TimeoutError: still busy, or D's blocks still held, after REQUEST_DEADLINE_S.
    """
    step_until([p, d], lambda: not p.llm_engine.has_work() and not d.llm_engine.has_work()
                and d.reset_prefix_cache(), "settling P and D")


def prefill(p: LLM, prompt: list[int]) -> JSONObject:
    """P's leg (max_tokens 1, do_remote_decode): the kv_transfer_params for D."""
    from pdkv import SamplingParams

    eng = p.llm_engine
    req, text = eng.make_request(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=1),
        kv_transfer_params={"do_remote_decode": True},
    )
    eng.add_request(req, text)
    out: list[RequestOutput] = []

    def finished() -> bool:
        out.extend(o for o in eng.step() if o.finished)
        return bool(out)

    step_until([], finished, "P's prefill")
    params = out[0].kv_transfer_params
    if not params:
        raise RuntimeError("P's prefill returned no kv_transfer_params")
    return dict(params)


def decode(p: LLM, d: LLM, prompt: list[int], params: JSONObject) -> Pull:
    """D's leg (greedy, NEW_TOKENS tokens; P stepped too): D's output tokens and what the pull
    cost (bytes, read ops, transfer seconds).

    Raises:
        RuntimeError: D found local prefix hits (the pull would not be whole) or no pull happened.
    """
    from pdkv import SamplingParams

    eng, sched = d.llm_engine, d.llm_engine.scheduler
    sched.stats()  # drain transfer times of earlier pulls
    before = dict(sched.kv_stats)
    req, text = eng.make_request(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        kv_transfer_params=params,
    )
    eng.add_request(req, text)
    out: list[RequestOutput] = []

    def step() -> bool:
        out.extend(o for o in eng.step() if o.finished and o.request_id == req.request_id)
        p.llm_engine.step()
        return bool(out)

    step_until([], step, "D's decode")
    if req.num_local_hit_tokens:
        raise RuntimeError(
            f"D had {req.num_local_hit_tokens} local prefix-hit tokens: the pull was not whole"
        )
    after = sched.kv_stats
    seconds = list(sched.stats().transfer_seconds or [])
    if not seconds:
        raise RuntimeError("no KV pull was recorded: see D's log")
    return {
        "tokens": list(out[0].outputs[0].token_ids),
        "bytes": int(after.get("kv_bytes_received", 0.0) - before.get("kv_bytes_received", 0.0)),
        "read_ops": int(after.get("kv_read_ops", 0.0) - before.get("kv_read_ops", 0.0)),
        "transfer_s": max(seconds),
    }
