"""Tokenizer and chat template of a model folder (transformers' fast tokenizer)."""

from __future__ import annotations

from typing import Any


class Tokenizer:
    """Encode/decode text and render chat messages with the model's own template.

    Args:
        path: HF model folder with tokenizer.json / tokenizer_config.json.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.vocab_size: int = len(self._tok)

    @property
    def hf(self) -> Any:
        """The underlying transformers tokenizer."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the model's tokenizer adds by default."""
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
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

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat (the template carries its own special tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return list(self._tok.encode(text, add_special_tokens=False))
