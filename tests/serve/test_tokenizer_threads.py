"""The server never tokenizes on the event loop and never shares a tokenizer instance between
threads (a fast tokenizer used by two threads at once can fail with "Already borrowed"): every
Tokenizer call is recorded with its instance and thread while real requests run in process."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Any

import httpx
import pytest

from pdkv import LLM
from pdkv.engine.async_llm import AsyncLLM
from pdkv.serve.api_server import ServeConfig, build_app
from pdkv.serve.metrics import ServerMetrics
from pdkv.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

ENCODING = ("encode", "encode_chat", "apply_chat_template")


def test_tokenizer_instances_stay_on_one_thread_and_off_the_event_loop(monkeypatch):
    uses: dict[int, set[int]] = defaultdict(set)  # id(instance) -> thread idents
    encodes_on: set[int] = set()  # threads that encoded text
    lock = threading.Lock()

    def record(tok: Tokenizer, encoding: bool) -> None:
        with lock:
            uses[id(tok)].add(threading.get_ident())
            if encoding:
                encodes_on.add(threading.get_ident())

    def spy(name: str) -> Any:
        real = getattr(Tokenizer, name)

        def wrapper(self: Tokenizer, *args: Any, **kwargs: Any) -> Any:
            record(self, name in ENCODING)
            return real(self, *args, **kwargs)

        return wrapper

    def hf(self: Tokenizer) -> Any:  # direct use of the transformers tokenizer (encodes)
        record(self, True)
        return self._tok

    for name in (*ENCODING, "decode"):
        monkeypatch.setattr(Tokenizer, name, spy(name))
    monkeypatch.setattr(Tokenizer, "hf", property(hf))

    engine = LLM("smollm2", num_kv_blocks=64, max_model_len=256).llm_engine
    llm = AsyncLLM(engine)
    llm.start()
    try:
        app = build_app(llm, ServeConfig(), ServerMetrics("smollm2"))

        async def main() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://t", timeout=120
            ) as c:
                chat = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6,
                        "temperature": 0, "logprobs": True, "top_logprobs": 2}
                return list(await asyncio.gather(
                    c.post("/v1/completions", json={"prompt": "Hello, my name is", "max_tokens": 6,
                                                    "temperature": 0, "logprobs": 2}),
                    c.post("/v1/completions", json={"prompt": "A story: ", "max_tokens": 6,
                                                    "temperature": 0, "stream": True}),
                    c.post("/v1/chat/completions", json=chat),
                    c.post("/v1/completions", json={"prompt": "word " * 400, "max_tokens": 4}),
                    c.post("/tokenize", json={"prompt": "Hello world"}),
                    c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}),
                    c.post("/detokenize", json={"tokens": [19556, 905]}),
                ))

        responses = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        llm.shutdown()
    assert [r.status_code for r in responses] == [200, 200, 200, 400, 200, 200, 200]
    assert "maximum context length" in responses[3].json()["error"]["message"]
    assert responses[6].json()["prompt"] == "Hello world"
    shared = {inst: threads for inst, threads in uses.items() if len(threads) > 1}
    assert not shared, f"tokenizer instances used from several threads: {shared}"
    assert uses[id(engine.tokenizer)], "the engine's detokenizer was not observed"
    assert threading.get_ident() not in encodes_on, "text was tokenized on the event loop thread"
