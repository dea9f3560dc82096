"""Tokenizer and chat template of a model folder (transformers' fast tokenizer), and a pool that
runs tokenizer work on worker threads, one instance per thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


class Tokenizer:
    """Encode/decode text and render chat messages with the model's own template.

    Args:
        path: HF model folder with tokenizer.json / tokenizer_config.json.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.vocab_size: int = len(self._tok)

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The underlying transformers tokenizer."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens the model's tokenizer adds by default
        (BOS for many) unless add_special_tokens is False."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids` (special tokens dropped unless skip_special_tokens is False)."""
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render messages ([{"role", "content"}, ...]) as the prompt text.

        Raises:
            ValueError: the model has no chat template or a message is malformed.
        """
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat messages need 'role' and 'content', got {m!r}")
        return str(
            self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of the rendered chat (the template carries its own special tokens; the
        tokenizer's are added too only with add_special_tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))


class TokenizerPool:
    """Tokenizer work off the caller's thread, with one Tokenizer instance per worker thread.

    A fast (Rust) tokenizer must not be used by two threads at once ("Already borrowed"), and
    long prompts must not stall an asyncio event loop: the server submits encode/decode work
    here, while the engine loop keeps its own instance for detokenization.

    Args:
        path: HF model folder (as for Tokenizer).
        num_threads: worker threads, each loading its own instance on first use.
    """

    def __init__(self, path: str, num_threads: int = 2) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.path = path
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="pdkv-tokenize")

    def _tokenizer(self) -> Tokenizer:
        tok: Tokenizer | None = getattr(self._local, "tok", None)
        if tok is None:
            tok = Tokenizer(self.path)
            self._local.tok = tok
        return tok

    def submit(self, fn: Callable[[Tokenizer], T]) -> Future[T]:
        """Run `fn(tokenizer)` on a worker thread with that thread's own instance; the future
        carries its result or exception."""
        return self._executor.submit(lambda: fn(self._tokenizer()))

    def shutdown(self) -> None:
        """Stop the workers (queued work is cancelled)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
