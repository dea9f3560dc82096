"""Benchmark prompts for `pdkv bench offline`: deterministic real text of an exact token length."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Fixed English text; each prompt is one distinct opening sentence followed by this paragraph
# (repeated as needed), cut to exactly input_len tokens.
_PARAGRAPH = (
    "The river begins high in the mountains, where snow melts each spring and feeds a "
    "hundred small streams. These streams join in a narrow valley and become a fast, cold "
    "current that cuts through the rock. Further down, the valley opens into wide farmland, "
    "and the river slows, bends and spreads into marshes where birds stop on their long "
    "journeys north and south. Towns were built along its banks because the water carried "
    "boats, turned mill wheels and watered the fields. Over the centuries people built "
    "bridges, dams and canals, and the river changed as much as the towns did. Today "
    "scientists measure its flow, its temperature and the life it carries, and they warn that "
    "warmer winters bring less snow and earlier floods. "
)

_SUBJECTS = (
    "a library", "a harbour", "a vineyard", "an orchard", "a lighthouse", "a bakery",
    "a railway", "a museum", "a forest", "a glacier", "a market", "a school",
    "an observatory", "a garden", "a bridge", "a mine",
)


def build_prompts(tokenizer: PreTrainedTokenizerBase, batch_size: int, input_len: int,
                  seed: int = 0) -> list[list[int]]:
    """Deterministic real-text prompts, all exactly `input_len` tokens long and pairwise different.

    Prompt i starts with its own sentence (request number, seed and subject), so prompts differ
    from their first tokens on and share no prefix-cache block; the fixed paragraph follows.

    Args:
        tokenizer: a transformers tokenizer (the model's).
        batch_size: number of prompts (requests).
        input_len: tokens per prompt.
        seed: varies the opening sentences.

    Returns:
        `batch_size` lists of `input_len` token ids (no special tokens added).
    """
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    rng = random.Random(seed)
    para_ids = list(tokenizer.encode(_PARAGRAPH, add_special_tokens=False))
    prompts = []
    for i in range(batch_size):
        subject = _SUBJECTS[rng.randrange(len(_SUBJECTS))]
        head = (
            f"Report {i + 1} (series {seed}, code {rng.randrange(10**6):06d}) "
            f"describes {subject} near the river. "
        )
        ids = list(tokenizer.encode(head, add_special_tokens=False))
        while len(ids) < input_len:
            ids.extend(para_ids)
        prompts.append(ids[:input_len])
    return prompts
