"""Completions and chat completions: request → engine request, outputs → OpenAI JSON / SSE."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict, TypeVar

from pdkv.engine.async_llm import AsyncLLM, EngineDeadError
from pdkv.jsontypes import JSONObject
from pdkv.model.structured import compile_grammar
from pdkv.outputs import Logprob, RequestOutput
from pdkv.sampling_params import SamplingParams, clean_logit_bias
from pdkv.serve.fanout import merge_streams
from pdkv.serve.fields import (
    MAX_N,
    field_in,
    prompt_logprobs_wanted,
    structured_field,
    structured_outputs,
    unsupported_field,
)
from pdkv.serve.protocol import ChatCompletionRequest, CompletionRequest
from pdkv.serve.response_json import (
    ChatChoice,
    ChatCompletionResponse,
    ChunkHead,
    CompletionChoice,
    CompletionResponse,
    StreamChoice,
    StreamChunk,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    usage_json,
)
from pdkv.serve.timings import engine_timings, prompt_tokens
from pdkv.tokenizer import Tokenizer, TokenizerPool

T = TypeVar("T")


class ErrorDetail(TypedDict):
    """OpenAI's error object (`code`: the HTTP status; `param`: the request field at fault)."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(TypedDict):
    """OpenAI's error JSON."""

    error: ErrorDetail


class APIError(Exception):
    """An error answered with OpenAI's error JSON.

    Args:
        message: what is wrong (shown to the client).
        status: HTTP status (400 bad input, 404, 500 internal, 503 engine down).
        err_type: OpenAI error type name.
    """

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param

    def body(self) -> ErrorBody:
        """The error as OpenAI's error JSON."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


@dataclass
class PreparedRequest:
    """A validated request ready for the engine."""

    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    kv_transfer_params: JSONObject | None
    cache_salt: str | None
    received: float = 0.0  # time.monotonic() when the handler started on it (s)
    echo: bool = False  # completions: the prompt text starts the output text


class OpenAIHandlers:
    """Builds engine requests from OpenAI bodies and formats the outputs.

    Prompts are tokenized on the pool's threads (never on the event loop, never with the engine
    loop's instance); the event loop thread has its own instance for the cheap per-token decodes
    of logprobs.

    Args:
        llm: the async engine.
        served_model_name: the only accepted `model` value (None/absent is accepted too).
        tokenizers: where prompts are tokenized.
    """

    def __init__(self, llm: AsyncLLM, served_model_name: str, tokenizers: TokenizerPool,
                 aliases: tuple[str, ...] = ()) -> None:
        self.llm = llm
        self.model_name = served_model_name
        self.model_aliases = aliases  # more accepted `model` values (--served-model-name A B ...)
        self.tokenizers = tokenizers
        self.tokenizer = Tokenizer(tokenizers.path)  # event loop thread only
        self.max_model_len = llm.engine.config.model_config.max_model_len

    # ------------------------------------------------------------------ input
    def check_model(self, model: str | None) -> None:
        """Raises APIError (404 NotFoundError, param "model": what OpenAI and vLLM answer) when
        `model` is given and is not a served name."""
        if model is not None and model != self.model_name and model not in self.model_aliases:
            served = ", ".join(f"`{n}`" for n in (self.model_name, *self.model_aliases))
            raise APIError(f"The model `{model}` does not exist; this server serves {served}.", 404,
                           "NotFoundError", param="model")

    async def tokenize(self, fn: Callable[[Tokenizer], T]) -> T:
        """`fn(tokenizer)` on a tokenizer pool thread; a ValueError becomes APIError (400)."""
        try:
            return await asyncio.wrap_future(self.tokenizers.submit(fn))
        except ValueError as e:
            raise APIError(str(e)) from None

    async def prepare_completion(
        self, req: CompletionRequest, request_id: str | None
    ) -> PreparedRequest:
        """Validate and tokenize a completion body. Raises APIError (400) on bad input."""
        received = time.monotonic()
        self.check_model(req.model)
        prompt = _one_prompt(req.prompt)
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = await self.tokenize(lambda tok: tok.encode(prompt)) if prompt else []
        else:
            text, ids = None, list(prompt)
        prepared = self._prepare(req, request_id, ids, text, req.max_tokens, req.logprobs,
                                 chat=False, received=received)
        if req.echo:
            prepared.echo = True
            if prepared.prompt_text is None:
                # The engine checks token ids when the request is added; echo decodes them first.
                vocab = self.llm.engine.vocab_size
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                   param="prompt")
                prepared.prompt_text = await self.tokenize(
                    lambda tok: tok.decode(ids, skip_special_tokens=False)
                )
        return prepared

    async def prepare_chat(
        self, req: ChatCompletionRequest, request_id: str | None
    ) -> PreparedRequest:
        """Validate, render and tokenize a chat body. Raises APIError (400) on bad input."""
        received = time.monotonic()
        self.check_model(req.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise APIError(str(e)) from None

        def render(tok: Tokenizer) -> tuple[str, list[int]]:
            text = tok.apply_chat_template(messages, req.add_generation_prompt)
            return text, list(tok.hf.encode(text, add_special_tokens=False))

        text, ids = await self.tokenize(render)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self._prepare(
            req, request_id, ids, text, max_tokens, logprobs, chat=True, received=received
        )

    def _prepare(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        request_id: str | None,
        ids: list[int],
        text: str | None,
        max_tokens: int | None,
        logprobs: int | None,
        chat: bool,
        received: float | None = None,
    ) -> PreparedRequest:
        bad = unsupported_field(req)
        if bad is not None:
            raise APIError(f"{bad[0]}: {bad[1]}", param=bad[0])
        if req.n > MAX_N:
            raise APIError(f"n must be at most {MAX_N}, got {req.n}", param="n")
        if not ids:
            raise APIError("prompt is empty: at least one token is needed",
                           param="messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        if len(ids) >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(ids)} tokens, which leaves no room for output."
            )
        if max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
        if max_tokens >= 1 and len(ids) + max_tokens > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                "for the completion). Reduce the prompt or max_tokens."
            )
        try:
            params = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                n=req.n,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0
                if req.repetition_penalty is None
                else req.repetition_penalty,
                min_p=req.min_p or 0.0,
                prompt_logprobs=prompt_logprobs_wanted(req),
                structured_outputs=structured_outputs(req),
                # After structured_outputs(req), whose errors come first, as when only the
                # dataclass cleaned it (cleaning a clean one again changes nothing).
                logit_bias=None if req.logit_bias is None else clean_logit_bias(req.logit_bias),
            )
            if params.structured_outputs is not None:
                compile_grammar(params.structured_outputs)
        except ValueError as e:
            msg = str(e)
            if msg.startswith("structured output grammar"):
                field = structured_field(req)
                raise APIError(f"{field}: {msg}", param=field) from None
            raise APIError(msg, param=field_in(msg)) from None
        prefix = "chatcmpl" if chat else "cmpl"
        return PreparedRequest(
            request_id=request_id or f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_name,
            prompt_ids=ids,
            prompt_text=text,
            params=params,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            chat=chat,
            kv_transfer_params=req.kv_transfer_params,
            cache_salt=req.cache_salt,
            received=time.monotonic() if received is None else received,
        )

    # ---------------------------------------------------------------- running
    def outputs(self, p: PreparedRequest) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Validate in the engine and start generation: (sequence index, output) pairs; n > 1
        runs one engine request per sequence (ids `<id>-<i>`, pdkv.serve.fanout).

        Raises:
            APIError: the engine rejected the request (400).
        """
        n = p.params.n
        made = []
        try:
            for i in range(n):
                made.append(self.llm.make_request(
                    {"prompt_token_ids": p.prompt_ids, "prompt": p.prompt_text},
                    p.params.child(i),
                    p.request_id if n == 1 else f"{p.request_id}-{i}",
                    kv_transfer_params=p.kv_transfer_params,
                    cache_salt=p.cache_salt,
                ))
        except ValueError as e:
            raise APIError(str(e), param=field_in(str(e))) from None
        return merge_streams([self.llm.generate(request, text) for request, text in made])

    async def full_response(
        self, p: PreparedRequest, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> ChatCompletionResponse | CompletionResponse:
        """Wait for the final outputs and build the non-streaming response body (one choice per
        sequence; `pdkv_timings` of sequence 0, pdkv.serve.timings).

        Raises:
            APIError: a sequence failed in the engine (500).
        """
        finals: dict[int, RequestOutput] = {}
        async for i, out in outputs:
            finals[i] = out
        chat_choices: list[ChatChoice] = []
        text_choices: list[CompletionChoice] = []
        for i in sorted(finals):
            final = finals[i]
            comp = final.outputs[0]
            if comp.finish_reason == "error":
                raise APIError(final.error or "request failed", 500, "InternalServerError")
            if p.chat:
                chat_choices.append({
                    "index": i,
                    "message": {"role": "assistant", "content": comp.text},
                    "logprobs": chat_logprobs(comp.token_ids, comp.logprobs, self._token_str),
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason,
                })
            else:
                ids = comp.token_ids
                lps: Sequence[dict[int, Logprob] | None] | None = comp.logprobs
                if p.echo and lps is not None and final.prompt_logprobs is not None:
                    ids = final.prompt_token_ids + ids  # echo: the prompt's logprobs first
                    lps = [*final.prompt_logprobs, *lps]
                text_choices.append({
                    "index": i,
                    "text": (p.prompt_text or "") + comp.text if p.echo else comp.text,
                    "logprobs": completion_logprobs(ids, lps, self._token_str),
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason,
                    "prompt_logprobs": prompt_logprobs_json(final),
                })
        first = finals[0]
        if p.chat:
            return {
                "prompt_logprobs": prompt_logprobs_json(first),
                "id": p.request_id,
                "object": "chat.completion",
                "created": p.created,
                "model": p.model,
                "choices": chat_choices,
                "usage": usage_json(list(finals.values())),
                "kv_transfer_params": first.kv_transfer_params,
                "pdkv_timings": engine_timings(p.received, first.metrics, time.monotonic(),
                                               prompt_tokens(first)),
            }
        return {
            "id": p.request_id,
            "object": "text_completion",
            "created": p.created,
            "model": p.model,
            "choices": text_choices,
            "usage": usage_json(list(finals.values())),
            "kv_transfer_params": first.kv_transfer_params,
            "pdkv_timings": engine_timings(p.received, first.metrics, time.monotonic(),
                                               prompt_tokens(first)),
        }

    async def stream_response(
        self, p: PreparedRequest, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        """SSE events: content deltas (choice index = sequence), a final chunk per sequence with
        finish_reason (and kv_transfer_params, `pdkv_timings`: pdkv.serve.timings), usage, then
        [DONE]. With echo, each sequence starts with the prompt text."""
        obj = "chat.completion.chunk" if p.chat else "text_completion"
        head: ChunkHead = {"id": p.request_id, "object": obj, "created": p.created,
                           "model": p.model}
        for i in range(p.params.n):
            if p.chat:
                first: StreamChoice = {"index": i, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}
                yield _sse(_chunk(head, [first]))
            elif p.echo:
                echo: StreamChoice = {"index": i, "text": p.prompt_text or "", "logprobs": None,
                                      "finish_reason": None}
                yield _sse(_chunk(head, [echo]))
        finals: dict[int, RequestOutput] = {}
        first_text: float | None = None  # when the first chunk carrying text was built
        prompt_lp_sent: set[int] = set()
        try:
            async for index, out in outputs:
                finals[index] = out
                comp = out.outputs[0]
                if comp.finish_reason == "error":
                    raise APIError(out.error or "request failed", 500, "InternalServerError")
                lps = (
                    comp.logprobs[len(comp.logprobs) - len(comp.delta_token_ids) :]
                    if comp.logprobs
                    else None
                )
                if not comp.delta_text and not out.finished and not lps:
                    continue
                choice: StreamChoice = {"index": index, "finish_reason": comp.finish_reason}
                if p.chat:
                    choice["delta"] = {"content": comp.delta_text} if comp.delta_text else {}
                    choice["logprobs"] = chat_logprobs(comp.delta_token_ids, lps, self._token_str)
                else:
                    choice["text"] = comp.delta_text
                    choice["logprobs"] = completion_logprobs(
                        comp.delta_token_ids, lps, self._token_str
                    )
                if out.finished:
                    choice["stop_reason"] = comp.stop_reason
                if out.prompt_logprobs is not None and index not in prompt_lp_sent:
                    prompt_lp_sent.add(index)  # with the sequence's first chunk, as vLLM
                    choice["prompt_logprobs"] = prompt_logprobs_json(out)
                if first_text is None and comp.delta_text:
                    first_text = time.monotonic()
                chunk = _chunk(head, [choice])
                if out.finished:
                    chunk["kv_transfer_params"] = out.kv_transfer_params
                    chunk["pdkv_timings"] = engine_timings(
                        p.received,
                        out.metrics,
                        first_text if first_text is not None else time.monotonic(),
                        prompt_tokens(out),
                    )
                yield _sse(chunk)
        except APIError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
            return
        except EngineDeadError as e:
            yield _sse(APIError(str(e), 503, "ServiceUnavailableError").body())
            yield "data: [DONE]\n\n"
            return
        except Exception as e:  # noqa: BLE001 - the stream already started: end it with an error event
            yield _sse(APIError(f"internal error: {e}", 500, "InternalServerError").body())
            yield "data: [DONE]\n\n"
            return
        if p.include_usage and finals:
            usage_chunk = _chunk(head, [])
            usage_chunk["usage"] = usage_json(list(finals.values()))
            yield _sse(usage_chunk)
        yield "data: [DONE]\n\n"

    def _token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)


def _chunk(head: ChunkHead, choices: list[StreamChoice]) -> StreamChunk:
    """A stream chunk: `head`'s fields, then `choices`."""
    return {"id": head["id"], "object": head["object"], "created": head["created"],
            "model": head["model"], "choices": choices}


def _sse(obj: StreamChunk | ErrorBody) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _one_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """A completion body's one prompt: text or token ids (a batch of one taken out of it).

    Raises:
        APIError: a batch of several prompts (400).
    """
    if isinstance(prompt, str):
        return prompt
    ids: list[int] = []
    for item in prompt:  # the schema's lists are all ints, all strings or all lists
        if isinstance(item, (str, list)):
            if len(prompt) != 1:
                raise APIError("batched prompts are not supported: send one prompt per request",
                               param="prompt")
            return item
        ids.append(item)
    return ids
