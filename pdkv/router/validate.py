"""What the proxy checks before the prefill leg: strict JSON, and the fields the prefill leg
rewrites (so that P cannot reject them and D would, after a wasted prefill).

The prefill leg forces max_tokens=1, drops min_tokens/stream_options and turns streaming off;
every other field reaches P unchanged and P rejects it for free. So the proxy checks, with the
servers' own request schemas: max_tokens / max_completion_tokens (>= 1), min_tokens (>= 0 and not
above max_tokens), stream / stream_options, and that prompt + max_tokens fits D's max_model_len.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import NoReturn

from pydantic import ValidationError

from pdkv.jsontypes import JSONObject
from pdkv.serve.protocol import ChatCompletionRequest, CompletionRequest, find_lone_surrogate


class BadRequest(ValueError):
    """The client's request is invalid (answered with a 400 in OpenAI's error JSON)."""


def _no_constant(name: str) -> NoReturn:
    raise BadRequest(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"number {text[:40]} is out of range (numbers must be finite)")
    return value


def parse_body(raw: bytes) -> JSONObject:
    """The request body as a JSON object, strictly: UTF-8, no NaN/Infinity, no number that
    overflows a float (1e400), no lone surrogates.

    Raises:
        BadRequest: anything else (message suitable for the client).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("request body is not valid UTF-8") from None
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except BadRequest:
        raise
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    where = find_lone_surrogate(body)
    if where is not None:
        raise BadRequest(
            f"request body contains a lone surrogate (invalid Unicode) in a string ({where})"
        )
    return body


@dataclass(frozen=True)
class LengthCheck:
    """What the length check needs from a request.

    Attributes:
        max_tokens: the output budget D will use (None: D fills up to max_model_len, always fits).
        prompt_ids: the prompt's token count when it is known without tokenizing (token ids).
        tokenize_body: a POST /tokenize body for D otherwise.
        upper_bound: an upper bound on the prompt's tokens without tokenizing (None: unknown).
    """

    max_tokens: int | None
    prompt_ids: int | None = None
    tokenize_body: JSONObject | None = None
    upper_bound: int | None = None

    def fits(self, prompt_tokens: int, max_model_len: int) -> str | None:
        """None when prompt + max_tokens fits, else D's error message."""
        if self.max_tokens is None or prompt_tokens + self.max_tokens <= max_model_len:
            return None
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + self.max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{self.max_tokens} for the completion). Reduce the prompt or max_tokens."
        )


SPECIAL_TOKENS_SLACK = 4
"""Tokens a tokenizer may add to a prompt beyond its text (BOS, ...) in `byte_bound`."""


def byte_bound(text: str) -> int:
    """An upper bound on the tokens of `text` without tokenizing it: its UTF-8 bytes plus
    SPECIAL_TOKENS_SLACK (a byte-level BPE gives at most one token per byte; a special token's
    text is several bytes for one token)."""
    return len(text.encode("utf-8")) + SPECIAL_TOKENS_SLACK


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def check_body(body: JSONObject, chat: bool) -> LengthCheck:
    """Validate the fields the prefill leg rewrites (see module docstring).

    Returns:
        what the caller needs for the prompt-length check.
    Raises:
        BadRequest: a field D would reject.
    """
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(body.get(key), bool):
            raise BadRequest(f"{key} must be an integer, got {body[key]!r}")
    schema = ChatCompletionRequest if chat else CompletionRequest
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        raise BadRequest(_validation_message(e)) from None
    if isinstance(req, ChatCompletionRequest):
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    else:
        max_tokens, name = req.max_tokens, "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"{name} must be at least 1, got {max_tokens}")
    if req.min_tokens < 0:
        raise BadRequest(f"min_tokens must be >= 0, got {req.min_tokens}")
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})")
    if max_tokens is None:
        return LengthCheck(None)
    if isinstance(req, ChatCompletionRequest):
        return LengthCheck(max_tokens, tokenize_body={
            "model": req.model, "messages": body.get("messages"),
            "add_generation_prompt": req.add_generation_prompt})
    prompt: object = req.prompt  # narrowed below: a batch of one is taken out of its list
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return LengthCheck(max_tokens, tokenize_body={"model": req.model, "prompt": prompt},
                           upper_bound=byte_bound(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return LengthCheck(max_tokens, prompt_ids=len(prompt))
    return LengthCheck(None)  # batched prompts: P rejects them itself
