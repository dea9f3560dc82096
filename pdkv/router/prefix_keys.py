"""The proxy's view of a request's KV: token ids and chunk hashes, torch-free.

The proxy tokenizes like the engine (`pdkv.serve.handlers`): a completion's text prompt is
encoded with the tokenizer's default special tokens, a chat is rendered with the model's own chat
template and encoded without special tokens, a prompt of token ids is taken as is. It then hashes
the ids with the engine's pure functions (`pdkv.block_hashing.hash_request_tokens`, cache_salt
in block 0) and keeps the hash of every full chunk (`pdkv.kvpool.keys.chunk_hashes`), so its
chunk hashes are the pool's (a pool key is `pdkv:<namespace fingerprint>:<chunk hash>`).

Only the `tokenizers` library (tokenizer.json) and jinja2 (the chat template, rendered the way
transformers renders it: sandboxed, trim_blocks, lstrip_blocks, loopcontrols, `tojson`,
`raise_exception`, `strftime_now`) are used, never transformers or torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from pdkv.block_hashing import hash_request_tokens
from pdkv.jsontypes import JSONObject, JSONValue
from pdkv.kvpool.keys import chunk_hashes

DEFAULT_BLOCK_SIZE = 16
"""Block size assumed for an engine that reports none (no kv connector: GET /kv_layout is 404);
the engine's own default."""


class KeysUnavailable(Exception):
    """The request's chunk hashes cannot be computed (no tokenizer, a body the engine would
    reject, a template error); the router then routes without them."""


@dataclass(frozen=True)
class Granularity:
    """How an engine cuts a prompt: tokens per block and per chunk (chunk = block without a
    pool). Raises ValueError unless chunk_size is a positive multiple of block_size."""

    block_size: int
    chunk_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ValueError(f"chunk_size {self.chunk_size} must be a positive multiple of "
                             f"block_size {self.block_size}")


def request_chunk_hashes(token_ids: Sequence[int], gran: Granularity,
                         cache_salt: str | None = None) -> list[bytes]:
    """Hash (32 bytes) of every full chunk of the prompt, in order; a chunk's hash is the engine's
    block hash of its last block, so it covers every earlier token and the salt."""
    blocks = hash_request_tokens(token_ids, gran.block_size, cache_salt)
    return chunk_hashes(blocks, gran.block_size, gran.chunk_size, len(token_ids))


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTokenizer:
    """tokenizer.json + the chat template of a model folder (`tokenizers` + jinja2).

    Args:
        folder: HF model folder (tokenizer.json; tokenizer_config.json; chat template in
            chat_template.jinja or tokenizer_config.json's "chat_template").
    Raises:
        OSError: tokenizer.json is missing or unreadable.
    """

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self._lock = threading.Lock()  # a Rust tokenizer is not to be shared by two threads at once
        config: JSONObject = {}
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                config = json.load(f)
        template = config.get("chat_template")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        self._template = None
        if isinstance(template, str):
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(template)
        self._specials = {k: _token_text(v) for k, v in config.items() if k.endswith("_token")}

    def encode(self, text: str) -> list[int]:
        """Ids of a completion prompt (the tokenizer's default special tokens added)."""
        with self._lock:
            return list(self._tok.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat (the chat template applied; not tokenized).

        Raises:
            KeysUnavailable: no chat template, or the template refused the messages.
        """
        if self._template is None:
            raise KeysUnavailable("the model has no chat template")
        from jinja2.exceptions import TemplateError

        try:
            return str(self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._specials
            ))
        except TemplateError as e:
            raise KeysUnavailable(f"chat template: {e}") from None

    def encode_chat(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Ids of a chat: the template's text, encoded without added special tokens.

        Raises:
            KeysUnavailable: no chat template, or the template refused the messages.
        """
        text = self.render_chat(messages, add_generation_prompt)
        with self._lock:
            return list(self._tok.encode(text, add_special_tokens=False).ids)


def _token_text(value: JSONValue) -> JSONValue:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value


def chat_messages(body: JSONObject) -> list[dict[str, str]]:
    """The chat body's messages as the engine renders them: role and text content (a list of
    text parts is joined, as `ChatMessage.text()` does).

    Raises:
        KeysUnavailable: a message the engine would reject.
    """
    out = []
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise KeysUnavailable("messages is not a list")
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(role, str):
            raise KeysUnavailable("a message has no role")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text":
                    raise KeysUnavailable("a content part is not text")
                parts.append(str(p.get("text", "")))
            content = "".join(parts)
        if not isinstance(content, str):
            raise KeysUnavailable("a message's content is not text")
        out.append({"role": role, "content": content})
    return out


def model_folder(name: str) -> str:
    """The folder of `name` (a folder, or a registry alias's folder under $PDKV_CACHE) without
    converting anything (that is the engine's job).

    Raises:
        KeysUnavailable: unknown name.
    """
    if os.path.isdir(name):
        return os.path.abspath(name)
    from pdkv.model.registry import ALIASES, cache_dir
    from pdkv.model.tiny import TINY_MODELS

    if name in ALIASES:
        return os.path.join(cache_dir(), "models", ALIASES[name].folder_name)
    if name in TINY_MODELS:
        return os.path.join(cache_dir(), "models", name)
    raise KeysUnavailable(f"unknown model {name!r} for the proxy's tokenizer")


class RequestKeyer:
    """Token ids of a request body, tokenizer loaded lazily from `model` (a folder or an alias;
    retried while the engine has not converted the model yet). None: token-id prompts only."""

    def __init__(self, model: str | None) -> None:
        self.model = model
        self._tok: ChatTokenizer | None = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> ChatTokenizer:
        if self.model is None:
            raise KeysUnavailable("the proxy has no tokenizer (--tokenizer)")
        with self._lock:
            if self._tok is None:
                folder = model_folder(self.model)
                try:
                    self._tok = ChatTokenizer(folder)
                except Exception as e:  # missing folder (not converted yet) or a bad tokenizer.json
                    raise KeysUnavailable(f"tokenizer of {self.model!r}: {e}") from None
            return self._tok

    @property
    def loaded(self) -> bool:
        """Whether the tokenizer is loaded (then `chat_text` does no file I/O)."""
        return self._tok is not None

    def load(self) -> None:
        """Load the tokenizer now if it can be (blocking: call off the loop); otherwise the
        first use tries again."""
        with contextlib.suppress(KeysUnavailable):
            self._tokenizer()

    def chat_text(self, body: JSONObject) -> str:
        """A chat body's prompt text as the engine renders it (blocking: call off the loop).

        Raises:
            KeysUnavailable: see the class doc; or no chat template, or messages the engine
                would reject.
        """
        gen = body.get("add_generation_prompt", True)
        return self._tokenizer().render_chat(chat_messages(body), bool(gen))

    def token_ids(self, body: JSONObject, chat: bool) -> list[int]:
        """The prompt's token ids as the engine will see them (blocking: call off the loop).

        Raises:
            KeysUnavailable: see the class doc.
        """
        if chat:
            gen = body.get("add_generation_prompt", True)
            return self._tokenizer().encode_chat(chat_messages(body), bool(gen))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt:
            ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
            if len(ids) == len(prompt):  # token ids only
                return ids
        if isinstance(prompt, str) and prompt:
            return self._tokenizer().encode(prompt)
        raise KeysUnavailable("no single prompt")
