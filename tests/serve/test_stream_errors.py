"""A stream that has started ends with an OpenAI error event and [DONE] when the engine dies
(503) or fails otherwise (500); no model needed."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdkv.engine.async_llm import EngineDeadError
from pdkv.sampling_params import SamplingParams
from pdkv.serve.handlers import OpenAIHandlers, PreparedRequest


def _prepared(chat: bool) -> PreparedRequest:
    return PreparedRequest(
        request_id="r1",
        created=0,
        model="smollm2",
        prompt_ids=[1],
        prompt_text=None,
        params=SamplingParams(),
        stream=True,
        include_usage=False,
        chat=chat,
        kv_transfer_params=None,
        cache_salt=None,
    )


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(("error", "code"), [(EngineDeadError("engine died: boom"), 503),
                                             (RuntimeError("boom"), 500)])
def test_stream_ends_with_error_event(chat, error, code):
    handlers = OpenAIHandlers.__new__(OpenAIHandlers)  # formatting only: no engine needed

    async def outputs():
        raise error
        yield  # pragma: no cover - makes this an async generator

    async def collect() -> list[str]:
        return [e async for e in handlers.stream_response(_prepared(chat), outputs())]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == code and "boom" in err["message"]
