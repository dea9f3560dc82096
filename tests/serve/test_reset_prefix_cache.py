"""POST /reset_prefix_cache: AsyncLLM runs the reset as a command on the engine loop thread
with a deadline (fake engines force the refusal, the stuck loop and the dead engine); on the
shared server a second identical prompt hits the prefix cache before a reset and not after."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from server_utils import metric_value

from pdkv.engine.async_llm import AsyncLLM, EngineDeadError
from pdkv.serve.api_server import ServeConfig, build_app
from pdkv.serve.metrics import ServerMetrics

pytestmark = pytest.mark.slow


class FakeEngine:
    """The parts of LLMEngine the loop and the route use; reset_prefix_cache answers `ok`,
    after waiting for `release` (a stuck loop) when it is given."""

    def __init__(
        self, model_path: str, ok: bool = True, release: threading.Event | None = None
    ) -> None:
        self.ok, self.release = ok, release
        self.calls: list[str] = []
        self.last_num_scheduled_tokens = 0
        self.config = SimpleNamespace(
            model_config=SimpleNamespace(path=model_path, max_model_len=256)
        )

    def reset_prefix_cache(self) -> bool:
        self.calls.append(threading.current_thread().name)
        if self.release is not None:
            self.release.wait(30)
        return self.ok

    def set_wakeup(self, wakeup: Any) -> None:
        pass

    def needs_step(self) -> bool:
        return False

    def next_deadline(self) -> None:
        return None

    def check_workers(self) -> None:  # in-process: never a lost rank
        pass

    def step(self) -> list[Any]:
        return []

    def shutdown(self) -> None:
        pass


async def _post_reset(llm: AsyncLLM, model_path: str) -> httpx.Response:
    app = build_app(llm, ServeConfig(), ServerMetrics("smollm2"))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        return await client.post("/reset_prefix_cache")


@pytest.fixture
def started():
    llms: list[AsyncLLM] = []

    def start(engine: FakeEngine) -> AsyncLLM:
        llm = AsyncLLM(engine)  # type: ignore[arg-type]
        llm.start()
        llms.append(llm)
        return llm

    yield start
    for llm in llms:
        llm.shutdown(timeout=5)


@pytest.mark.parametrize("ok, status", [(True, 200), (False, 409)])
def test_reset_runs_on_the_loop_thread_and_maps_to_status(started, model_path, ok, status):
    engine = FakeEngine(model_path, ok=ok)
    llm = started(engine)
    r = asyncio.run(_post_reset(llm, model_path))
    assert r.status_code == status, r.text
    if not ok:
        assert "in use" in r.json()["error"]["message"]
    assert engine.calls == ["pdkv-engine-loop"]


def test_reset_has_a_deadline_when_the_loop_is_stuck(started, model_path, monkeypatch):
    release = threading.Event()
    engine = FakeEngine(model_path, release=release)
    llm = started(engine)
    with pytest.raises(TimeoutError):
        asyncio.run(llm.reset_prefix_cache(timeout_s=0.2))
    monkeypatch.setattr("pdkv.serve.api_server.RESET_PREFIX_CACHE_TIMEOUT_S", 0.2)
    r = asyncio.run(_post_reset(llm, model_path))
    assert r.status_code == 504 and "did not reset" in r.json()["error"]["message"]
    release.set()  # the loop goes on; the late answers land on closed loops without harm
    deadline = time.monotonic() + 10
    while len(engine.calls) < 2:
        assert time.monotonic() < deadline, "the stuck loop never ran the second reset"
        time.sleep(0.01)
    assert asyncio.run(llm.reset_prefix_cache(timeout_s=10)) is True
    assert llm.is_running


def test_reset_on_a_dead_engine_is_503(model_path):
    llm = AsyncLLM(FakeEngine(model_path))  # type: ignore[arg-type]  # never started
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.reset_prefix_cache())
    assert asyncio.run(_post_reset(llm, model_path)).status_code == 503


def _prefix_hits(url: str) -> float:
    return metric_value(
        httpx.get(url + "/metrics", timeout=10).text, "pdkv:prefix_cache_hits_total"
    )


def _complete(url: str, prompt: str) -> dict[str, Any]:
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _reset_when_idle(url: str, timeout: float = 30.0) -> httpx.Response:
    """POST /reset_prefix_cache, retrying on 409 (requests of earlier tests may still hold
    blocks for a moment on the shared server)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(url + "/reset_prefix_cache", timeout=30)
        if r.status_code != 409 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_identical_prompt_hits_before_reset_and_misses_after(server):
    # A prompt no other test sends (several full blocks), so only this test's requests match it.
    prompt = f"[{uuid.uuid4().hex}] " + " ".join(
        f"Line {i} is about rivers and hills." for i in range(12)
    )
    first = _complete(server.url, prompt)
    n = first["usage"]["prompt_tokens"]
    assert n > 48
    hits0 = _prefix_hits(server.url)
    again = _complete(server.url, prompt)
    cached = (n - 1) // 16 * 16
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert _prefix_hits(server.url) - hits0 == cached

    r = _reset_when_idle(server.url)
    assert r.status_code == 200, r.text

    hits1 = _prefix_hits(server.url)
    after = _complete(server.url, prompt)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _prefix_hits(server.url) == hits1
    assert after["choices"][0]["text"] == first["choices"][0]["text"]


def test_offline_llm_reset_prefix_cache(reference_llm):
    from pdkv import SamplingParams

    prompt = f"[{uuid.uuid4().hex}] " + " ".join(f"Item {i} is a small red box." for i in range(10))
    params = SamplingParams(temperature=0, max_tokens=2)
    first = reference_llm.generate(prompt, params)[0]
    n = len(first.prompt_token_ids)
    assert reference_llm.generate(prompt, params)[0].num_cached_tokens == (n - 1) // 16 * 16 > 0
    free = reference_llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks
    assert reference_llm.reset_prefix_cache() is True
    assert reference_llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == free
    after = reference_llm.generate(prompt, params)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == first.outputs[0].token_ids
