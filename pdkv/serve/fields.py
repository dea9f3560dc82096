"""Which OpenAI / vLLM request fields this server honours: the 400s naming a field, the
structured-output fields turned into StructuredOutputsParams, and the prompt_logprobs an echo
needs. See docs/SERVING.md "Sampling and request fields"."""

from __future__ import annotations

from typing import Any

from pdkv.sampling_params import StructuredOutputsParams
from pdkv.serve.protocol import ChatCompletionRequest, CompletionRequest

# Most sequences one request may ask for (n).
MAX_N = 64


def unsupported_field(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, str] | None:
    """(field, why) of the first field in `req` that this server cannot honour, or None."""
    if req.tools:
        return "tools", "tool calling is not supported"
    if req.tool_choice not in (None, "none"):
        return "tool_choice", "tool calling is not supported (only tool_choice=none)"
    if req.functions:
        return "functions", "function calling is not supported"
    if req.function_call not in (None, "none"):
        return "function_call", "function calling is not supported"
    rf = req.response_format
    if rf is not None and rf.type not in ("text", "json_object", "json_schema"):
        return "response_format", f"response_format type {rf.type!r} is not supported"
    if req.prompt_logprobs is not None and req.kv_transfer_params:
        return "prompt_logprobs", "prompt_logprobs is not supported with kv_transfer_params (P/D)"
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and req.best_of != 1:
            return "best_of", "best_of is not supported (vLLM V1 has no best_of)"
        if req.suffix is not None:
            return "suffix", "suffix is not supported"
        if req.echo and req.logprobs is not None and (req.stream or req.kv_transfer_params):
            return "echo", ("echo with logprobs is not supported when streaming or with "
                            "kv_transfer_params (P/D); ask for prompt_logprobs instead")
    if req.n > 1 and req.kv_transfer_params:
        return "n", "n > 1 is not supported with kv_transfer_params (P/D): send n requests"
    return None


def structured_outputs(
    req: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    """The grammar a body asks for: response_format json_object / json_schema (OpenAI),
    guided_json / guided_regex / guided_choice / guided_grammar or structured_outputs (vLLM).

    Raises:
        ValueError: several of them, or a malformed one (the message names the field).
    """
    asked: list[tuple[str, dict[str, Any]]] = []  # (body field, StructuredOutputsParams kwargs)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema is not None else None
        if schema is None:
            raise ValueError("response_format: json_schema.schema must be a JSON schema object")
        asked.append(("response_format", {"json": schema}))
    if req.guided_json is not None:
        asked.append(("guided_json", {"json": req.guided_json}))
    if req.guided_regex is not None:
        asked.append(("guided_regex", {"regex": req.guided_regex}))
    if req.guided_choice is not None:
        asked.append(("guided_choice", {"choice": tuple(req.guided_choice)}))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", {"grammar": req.guided_grammar}))
    if req.structured_outputs is not None:
        # The body's object as keyword arguments, unchecked: the dataclass rejects a wrong
        # name (TypeError) or combination, and compile_grammar a wrong value.
        asked.append(("structured_outputs", dict(req.structured_outputs)))
    found = [(name, _params(name, kwargs)) for name, kwargs in asked]
    if len(found) > 1:
        raise ValueError(f"{found[1][0]}: only one kind of structured output per request, got "
                         f"{[f for f, _ in found]}")
    return found[0][1] if found else None


def prompt_logprobs_wanted(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """prompt_logprobs to ask the engine for: the request's, raised to `logprobs` for a
    completion with echo (its logprobs start with the prompt's, as in vLLM)."""
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        return max(req.logprobs, req.prompt_logprobs or 0)
    return req.prompt_logprobs


def structured_field(req: CompletionRequest | ChatCompletionRequest) -> str:
    for name in (
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ):
        if getattr(req, name) is not None:
            return name
    return "structured_outputs"


def field_in(message: str) -> str | None:
    """The request field a validation message starts with or names ("min_p must be ...")."""
    for name in (
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "logit_bias",
        "prompt_logprobs",
        "logprobs",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "stop",
        "n",
        "kv_transfer_params",
    ):
        if message.startswith((name + " ", name + ":", name + ".")) or f" {name} " in message:
            return name
    return None


def _params(name: str, kwargs: dict[str, Any]) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs) for body field `name`.

    Raises:
        ValueError: the dataclass refused them; the message starts with `name`, the field the
            client sent (so `param` names it, not structured_outputs).
    """
    try:
        return StructuredOutputsParams(**kwargs)
    except (TypeError, ValueError) as e:
        message = str(e)
        if message.startswith(f"{name}") and isinstance(e, ValueError):
            raise
        raise ValueError(f"{name}: {message}") from None

