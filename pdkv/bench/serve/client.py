"""HTTP side of `pdkv bench serve`: one streamed OpenAI request, timed chunk by chunk.

Any OpenAI-compatible server works (pdkv, vLLM, ...). Each request is a streaming POST
(`stream: true`, `stream_options.include_usage: true`, `temperature: 0`, `max_tokens` = the
requested output length, and vLLM's `ignore_eos` extension unless disabled) read as Server-Sent
Events: `data: {json}` lines until `data: [DONE]`. Timing rules: see `RequestResult`. A pdkv
server's or proxy's `pdkv_timings` (in the final chunk) is kept per request.
"""

from __future__ import annotations

import json
import time

import httpx

from pdkv.bench.serve.records import RequestResult, SampleRequest
from pdkv.jsontypes import JSONObject, as_object

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

_MAX_ERROR_CHARS = 500


def parse_endpoint(value: str) -> str:
    """Map "completions" / "chat" (or their paths, /v1/...) to "completions" / "chat"."""
    v = value.strip()
    for name, path in ENDPOINT_PATHS.items():
        if v in (name, path, path.lstrip("/")):
            return name
    if v in ("chat-completions", "chat_completions", "openai-chat"):
        return "chat"
    raise ValueError(f"unknown endpoint {value!r}: use completions or chat")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The `Authorization: Bearer` header when an API key is given, else {}."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_payload(
    endpoint: str, model: str, sample: SampleRequest, ignore_eos: bool = True
) -> JSONObject:
    """The JSON body of one streamed request for `endpoint` ("completions" or "chat")."""
    payload: JSONObject = {"model": model}
    if endpoint == "chat":
        messages = sample.messages or [{"role": "user", "content": sample.prompt}]
        payload["messages"] = [{k: v for k, v in m.items()} for m in messages]
    else:
        payload["prompt"] = sample.prompt
    payload.update(
        max_tokens=sample.output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def chunk_text(data: JSONObject, endpoint: str) -> str | None:
    """The text a parsed chunk carries (None when it has no choices, e.g. the usage chunk).

    For chat this is `delta.content` (or `delta.reasoning_content` / `delta.reasoning`);
    a role-only delta carries "" and so does not count as a token.
    """
    choices = data.get("choices")
    if not choices:
        return None
    if not isinstance(choices, list):
        raise TypeError(f"choices must be a JSON array, got {type(choices).__name__}")
    choice = as_object(choices[0], "a choice")
    if endpoint == "chat":
        delta = as_object(choice.get("delta") or {}, "a choice's delta")
        # Reasoning models stream their thinking in a separate field; it is output too.
        text = (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or "")
    else:
        text = choice.get("text") or ""
    if not isinstance(text, str):
        raise TypeError(f"a choice's text must be a string, got {type(text).__name__}")
    return text


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    endpoint: str,
    model: str,
    sample: SampleRequest,
    headers: dict[str, str] | None = None,
    ignore_eos: bool = True,
) -> RequestResult:
    """POST one streamed request to `url` and time it; never raises.

    Returns:
        A `RequestResult`; on an HTTP error, an exception, or a stream without any content
        chunk, `success` is False and `error` says why.
    """
    payload = build_payload(endpoint, model, sample, ignore_eos)
    out = RequestResult(prompt_len=sample.prompt_len, prompt_tokens=sample.prompt_len)
    texts: list[str] = []
    usage_output: int | None = None
    st = time.perf_counter()
    out.start_time = st
    last_content = st
    last_event = st
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status_code}: {body[:_MAX_ERROR_CHARS]}"
                return out
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separator, ": ping" comment, or an event:/id: field
                now = time.perf_counter()
                last_event = now
                body = line[len("data:"):].strip()
                if body == "[DONE]":
                    break
                data = json.loads(body)
                if "error" in data and not data.get("choices"):
                    raise RuntimeError(f"error event in stream: {data['error']}")
                timings = data.get("pdkv_timings")
                if isinstance(timings, dict):
                    out.pdkv_timings = timings
                usage = data.get("usage")
                if usage:
                    if usage.get("completion_tokens") is not None:
                        usage_output = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        out.prompt_tokens = int(usage["prompt_tokens"])
                text = chunk_text(data, endpoint)
                if not text:
                    continue
                if out.num_content_chunks == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last_content)
                last_content = now
                out.num_content_chunks += 1
                texts.append(text)
    except Exception as e:  # a failed request is data, not a crash
        out.error = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
        return out
    out.latency = last_event - st
    out.generated_text = "".join(texts)
    if out.num_content_chunks == 0:
        out.error = "no content chunk received: TTFT undefined, request counted as failed"
        return out
    if usage_output is None:
        out.usage_missing = True
        out.output_tokens = out.num_content_chunks
    else:
        out.output_tokens = usage_output
    out.success = True
    return out
