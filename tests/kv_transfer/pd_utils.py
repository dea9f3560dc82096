"""In-process prefill (P) and decode (D) engines wired by the P2P connector, stepped by hand."""

from __future__ import annotations

import json
import time
from typing import Any

from pdkv import LLM, SamplingParams
from pdkv.outputs import RequestOutput


def pd_config(role: str, transfer: str, policy: str = "fail", **extra: Any) -> str:
    return json.dumps({
        "kv_connector": "P2PConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"transfer": transfer, **extra},
    })


def make_pd(transfer: str, policy: str = "fail", num_kv_blocks: int = 256, max_model_len: int = 512,
            d_prefix_caching: bool = True, p_extra: dict[str, Any] | None = None,
            d_block_size: int = 16, p_block_size: int = 16) -> tuple[LLM, LLM]:
    p = LLM(
        "smollm2",
        num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        block_size=p_block_size,
        kv_transfer_config=pd_config("kv_producer", transfer, **(p_extra or {})),
    )
    d = LLM("smollm2", num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
            enable_prefix_caching=d_prefix_caching, block_size=d_block_size,
            kv_transfer_config=pd_config("kv_consumer", transfer, policy))
    return p, d


def prefill(p: LLM, prompt: Any, timeout: float = 60.0) -> RequestOutput:
    """The proxy's prefill leg: max_tokens=1 with do_remote_decode."""
    eng = p.llm_engine
    req, text = eng.make_request(prompt, SamplingParams(temperature=0, max_tokens=1),
                                 kv_transfer_params={"do_remote_decode": True})
    eng.add_request(req, text)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for out in eng.step():
            if out.finished and out.request_id == req.request_id:
                return out
    raise TimeoutError("prefill did not finish")


def pump(engines: list[LLM], until, timeout: float = 120.0) -> None:
    """Step every engine (P keeps serving reads, D pulls/decodes) until `until()` is true."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError("engines did not reach the expected state")
        for e in engines:
            e.llm_engine.step()
        time.sleep(0.001)


def decode(
    p: LLM, d: LLM, prompts: list[Any], params_list: list[dict | None], sp: SamplingParams
) -> list[RequestOutput]:
    """The decode leg for several requests at once; P is stepped too (it serves the reads)."""
    eng = d.llm_engine
    ids = []
    for prompt, params in zip(prompts, params_list):
        req, text = eng.make_request(prompt, sp, kv_transfer_params=params)
        eng.add_request(req, text)
        ids.append(req.request_id)
    done: dict[str, RequestOutput] = {}

    def step_all() -> bool:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        p.llm_engine.step()
        return len(done) == len(ids)

    pump([], step_all)
    return [done[i] for i in ids]


def free_blocks(llm: LLM) -> int:
    return llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks


def settle(p: LLM, d: LLM, timeout: float = 30.0) -> None:
    """Step both until neither holds blocks or has KV work (leases, notifications)."""
    def idle() -> bool:
        return all(
            not e.llm_engine.has_work()
            and free_blocks(e) == e.llm_engine.scheduler.kv_cache_manager.block_pools[0].num_blocks
            for e in (p, d)
        )
    pump([p, d], idle, timeout)


def shutdown(*llms: LLM) -> None:
    for llm in llms:
        llm.llm_engine.shutdown()


class PausedEngine:
    """Wraps a transfer engine: every `read` announces itself on `entered` and then blocks until
    the test sets `gate` (at most `max_wait` s), so a pull is reliably in flight."""

    def __init__(self, inner: Any, max_wait: float = 30.0) -> None:
        import threading

        self.inner = inner
        self.name = inner.name
        self.max_wait = max_wait
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def read(self, peer: Any, ops: Any, deadline: float, grant: Any = None) -> int:
        self.entered.set()
        self.gate.wait(self.max_wait)
        return int(self.inner.read(peer, ops, deadline, grant))


def pause_pulls(llm_or_worker: Any) -> PausedEngine:
    """Make the consumer's pulls block in `read` until the returned engine's gate is set."""
    engine = getattr(llm_or_worker, "llm_engine", None)
    worker = engine.runner.connector.worker if engine is not None else llm_or_worker
    paused = PausedEngine(worker.engine)
    worker.engine = paused
    worker.consumer.engine = paused
    return paused
