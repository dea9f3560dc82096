"""The model's own tokenizer on the client side of `pdkv bench serve`, for servers without
`/tokenize` (vLLM's benchmark always tokenizes locally, with `--tokenizer` or the model)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LocalTokenizer:
    """A transformers tokenizer loaded from a model folder: `encode` adds no special tokens
    (as `ServerTokenizer` asks the server), `decode` keeps them (as the server's /detokenize)."""

    name = "local"

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, source: str) -> None:
        self.hf = hf_tokenizer
        self.source = source

    async def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        return [int(t) for t in self.hf.encode(text, add_special_tokens=False)]

    async def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`."""
        return str(self.hf.decode([int(i) for i in ids], skip_special_tokens=False))


def load_local_tokenizer(name: str) -> LocalTokenizer:
    """The tokenizer of `name`: a pdkv alias (smollm2), a Hugging Face id (resolved offline, see
    `pdkv.model.registry.resolve_model`) or a model folder.

    Raises:
        ValueError: the name resolves to no local model (message from resolve_model).
    """
    from pdkv.model.registry import resolve_model
    from pdkv.tokenizer import Tokenizer

    path = resolve_model(name)
    return LocalTokenizer(Tokenizer(path).hf, path)


async def load_local_tokenizer_async(name: str) -> LocalTokenizer:
    """`load_local_tokenizer` on a worker thread (loading may convert a model on first use)."""
    return await asyncio.to_thread(load_local_tokenizer, name)
