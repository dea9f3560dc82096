"""AsyncLLM's engine loop, in process with the real model and the P2P connector (tcp):
a step that raises kills the engine (EngineDeadError for every stream, peers see it close);
an idle loop holding blocks sleeps instead of stepping; a decode request waiting for a remote
pull resumes on the connector's wakeup, not at the next lease deadline."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx
import pytest

from pdkv import LLM, SamplingParams
from pdkv.engine.async_llm import AsyncLLM, EngineDeadError
from pdkv.serve.api_server import ServeConfig, build_app
from pdkv.serve.metrics import ServerMetrics

pytestmark = pytest.mark.slow

PROMPT = "The history of the bicycle begins in the early nineteenth century, when"
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
PREFILL_LEG = {"do_remote_decode": True}


def _kv_config(role: str, lease_s: float) -> str:
    return json.dumps({
        "kv_connector": "P2PConnector", "kv_role": role, "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"transfer": "tcp", "kv_lease_duration": lease_s},
    })


def _engine(role: str, lease_s: float = 60.0) -> Any:
    return LLM("smollm2", num_kv_blocks=128, max_model_len=512,
               kv_transfer_config=_kv_config(role, lease_s)).llm_engine


async def _run(
    llm: AsyncLLM, prompt: Any, params: SamplingParams, kv: dict[str, Any] | None = None
) -> Any:
    """The final output of one request (or the exception its stream raised)."""
    request, text = llm.make_request(prompt, params, kv_transfer_params=kv)
    final = None
    async for out in llm.generate(request, text):
        final = out
    return final


async def _http_after_death(llm: AsyncLLM) -> tuple[int, httpx.Response]:
    app = build_app(llm, ServeConfig(), ServerMetrics("smollm2"))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        health = await client.get("/health")
        completion = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    return health.status_code, completion


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_failed_step_kills_engine_with_connector(monkeypatch):
    engine = _engine("kv_producer")
    llm = AsyncLLM(engine)
    deaths: list[BaseException] = []
    llm.add_dead_callback(deaths.append)
    real = engine.runner.execute_model
    state = {"fail": False}

    def execute(sched_out: Any) -> Any:
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("injected device fault")
        return real(sched_out)

    monkeypatch.setattr(engine.runner, "execute_model", execute)
    llm.start()
    try:
        async def main() -> tuple[Any, BaseException | None]:
            # A prefill leg finishes first and leaves its blocks held for a consumer.
            leg = await _run(llm, PROMPT, SamplingParams(temperature=0, max_tokens=1), PREFILL_LEG)
            assert leg.kv_transfer_params is not None
            assert llm.call(lambda e: e.scheduler.stats().num_blocks_held_for_remote) > 0
            # A long generation is running when one step raises.
            request, text = llm.make_request(PROMPT, LONG)
            got: BaseException | None = None
            n = 0
            try:
                async for _ in llm.generate(request, text):
                    n += 1
                    if n == 3:
                        state["fail"] = True
            except EngineDeadError as e:
                got = e
            return leg, got

        leg, got = asyncio.run(asyncio.wait_for(main(), 120))
        assert isinstance(got, EngineDeadError) and "injected device fault" in str(got)
        assert not llm.is_running
        assert isinstance(llm.errored, RuntimeError)
        _wait(
            lambda: bool(deaths), 10.0, "dead callbacks not called"
        )  # they run after the shutdown
        assert deaths == [llm.errored]
        # New requests are refused at once; the server front says so too.
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(_run(llm, PROMPT, LONG), 10))
        health, completion = asyncio.run(asyncio.wait_for(_http_after_death(llm), 30))
        assert health == 503
        assert completion.status_code == 503 and completion.json()["error"]["code"] == 503
        # The engine was shut down: a consumer trying to read the held blocks is refused now
        # instead of finding blocks that nobody will ever release.
        params = leg.kv_transfer_params
        with pytest.raises(OSError), socket.create_connection(
                (params["remote_host"], int(params["remote_port"])), timeout=5):
            pass
    finally:
        llm.shutdown()


def test_idle_loop_holding_blocks_sleeps():
    engine = _engine("kv_producer", lease_s=60.0)
    llm = AsyncLLM(engine)
    llm.start()
    try:
        leg = asyncio.run(asyncio.wait_for(
            _run(llm, PROMPT, SamplingParams(temperature=0, max_tokens=1), PREFILL_LEG), 60))
        assert leg.kv_transfer_params is not None
        steps_before = llm.call(
            lambda e: (e.num_steps, e.scheduler.stats().num_blocks_held_for_remote)
        )
        time.sleep(1.0)
        steps_after = llm.call(
            lambda e: (e.num_steps, e.scheduler.stats().num_blocks_held_for_remote)
        )
        assert steps_before[1] > 0 and steps_after[1] > 0, "blocks should stay held (lease 60 s)"
        # The old loop stepped about every millisecond here (hundreds of steps); the event-driven
        # loop steps only for the two `call` commands.
        assert steps_after[0] - steps_before[0] <= 3
    finally:
        llm.shutdown()


def test_decode_resumes_on_pull_wakeup_not_at_deadline():
    # Lease 60 s: the decode side's only deadline (lease renewal) is 20 s away, so only the
    # connector's wakeup can resume the request within the time asserted below.
    producer, consumer = AsyncLLM(_engine("kv_producer")), AsyncLLM(_engine("kv_consumer"))
    producer.start()
    consumer.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=8)

        async def main() -> tuple[Any, float]:
            leg = await _run(
                producer, PROMPT, SamplingParams(temperature=0, max_tokens=1), PREFILL_LEG
            )
            t0 = time.monotonic()
            out = await _run(consumer, PROMPT, params, leg.kv_transfer_params)
            return out, time.monotonic() - t0

        out, elapsed = asyncio.run(asyncio.wait_for(main(), 120))
        assert out.finished and len(out.outputs[0].token_ids) == 8
        assert elapsed < 10.0, (
            f"decode took {elapsed:.1f} s: it waited for a deadline, not the wakeup"
        )
        stats = consumer.call(lambda e: e.scheduler.kv_stats.get("kv_transfers", 0))
        assert stats == 1, "the KV was pulled, not recomputed"
        # The producer frees its blocks once the consumer's read is done (its own wakeup).
        _wait(lambda: producer.call(lambda e: e.scheduler.stats().num_blocks_held_for_remote) == 0,
              10.0, "producer still holds the blocks after the read")
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_request_starved_of_blocks_backs_off_then_runs_at_lease_expiry():
    # 10 blocks of 16 tokens: the first prefill leg holds 7 of them for a consumer that never
    # comes, so a second one must wait for the lease (3 s) to expire.
    engine = LLM("smollm2", num_kv_blocks=10, max_model_len=128,
                 kv_transfer_config=_kv_config("kv_producer", 3.0)).llm_engine
    llm = AsyncLLM(engine)
    llm.start()
    prompt = {"prompt_token_ids": list(range(1000, 1100))}
    one = SamplingParams(temperature=0, max_tokens=1)
    try:
        async def main() -> tuple[int, Any]:
            await _run(llm, prompt, one, PREFILL_LEG)
            second = asyncio.ensure_future(
                _run(llm, prompt | {"prompt_token_ids": list(range(2000, 2100))}, one, PREFILL_LEG)
            )
            await asyncio.sleep(0.3)
            held, waiting, steps0 = await asyncio.to_thread(
                llm.call,
                lambda e: (
                    e.scheduler.stats().num_blocks_held_for_remote,
                    e.scheduler.stats().num_waiting,
                    e.num_steps,
                ),
            )
            assert held > 0 and waiting == 1, "the second leg should be waiting for blocks"
            await asyncio.sleep(1.0)
            steps1 = await asyncio.to_thread(llm.call, lambda e: e.num_steps)
            return steps1 - steps0, await second

        steps, second = asyncio.run(asyncio.wait_for(main(), 60))
        # Without the back-off this loop runs thousands of empty steps per second.
        assert steps < 60, f"{steps} steps in 1 s while starved"
        assert second.finished and second.kv_transfer_params is not None
    finally:
        llm.shutdown()
