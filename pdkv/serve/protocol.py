"""OpenAI-compatible request schemas (pydantic, as FastAPI needs) with vLLM's extensions
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, prompt_logprobs,
include_stop_str_in_output, guided_*, kv_transfer_params, cache_salt).

Every OpenAI / vLLM field is declared, so none is dropped silently: the handlers either apply it
or answer 400 naming it (tools, structured output, ...). A field no schema knows is ignored with
a warning in the log, as vLLM does.

Every body rejects (400) NaN / Infinity (also 1e400, which JSON parsing turns into inf) in float
fields and any string holding a lone UTF-16 surrogate (e.g. "\ud800", valid JSON but not
Unicode); value ranges are checked by SamplingParams and the engine.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdkv.jsontypes import JSONObject, JSONValue

logger = logging.getLogger(__name__)


def find_lone_surrogate(data: object) -> str | None:
    """The JSON path ("messages.0.content") of a string in `data` (nested dicts and
    lists, keys included) that is not valid Unicode (a lone surrogate), or None."""
    stack: list[tuple[str, object]] = [("", data)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(item, dict):
            for k, v in item.items():
                stack.append((f"{path}.{k}" if path else str(k), k))
                stack.append((f"{path}.{k}" if path else str(k), v))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(item))
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: object) -> object:
        where = find_lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where} is not valid Unicode (a lone UTF-16 surrogate)")
        return data

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, data: object) -> object:
        if isinstance(data, dict):
            known = {f.alias or name for name, f in cls.model_fields.items()}  # wire names
            unknown = sorted(str(k) for k in data if k not in known)
            if unknown:
                logger.warning("The following fields were present in the request but ignored: %s",
                               unknown)
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`: a named JSON schema (vLLM's
    JsonSchemaResponseFormat; `schema` is the key on the wire)."""

    name: str | None = None
    description: str | None = None
    schema_: JSONObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`. `type`: "text", "json_object" or "json_schema" (a string
    here, so that another type is a 400 naming response_format, pdkv.serve.fields)."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    kv_transfer_params: JSONObject | None = None
    cache_salt: str | None = None
    user: str | None = None
    # Structured output (OpenAI's response_format, vLLM's guided_* / structured_outputs) and
    # tool calling: declared so that the handlers can answer 400 naming them.
    response_format: ResponseFormat | None = None
    guided_json: JSONValue = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: JSONObject | None = None
    tools: list[JSONObject] | None = None
    tool_choice: JSONValue = None
    functions: list[JSONObject] | None = None
    function_call: JSONValue = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions body."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Body):

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[JSONObject] | None = None

    def text(self) -> str:
        """The message text (text parts joined; other parts are rejected).

        Raises:
            ValueError: a non-text content part.
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"unsupported content part type {part.get('type')!r}")
            texts.append(str(part.get("text", "")))
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True


class TokenizeRequest(_Body):
    """POST /tokenize body: a prompt or chat messages. add_special_tokens as vLLM's: a prompt
    gets the tokenizer's special tokens (BOS) unless it is false; rendered chat messages carry
    their template's own and get none unless it is true."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize body."""

    model: str | None = None
    tokens: list[int]


class KVHeldRequest(_Body):
    """POST /kv_events/held body: a prompt's block hashes (hex, at the engine's block size, in
    prompt order; `pdkv.block_hashing.hash_request_tokens`)."""

    block_hashes: list[str]


class PushFirstTokenRequest(_Body):
    """POST /v1/kv/push_first_token/{request_id} body: P's sampled token (a token id) for D's
    push-mode request on a linear-state model (pdkv.serve.kv_push)."""

    first_token: int
