"""The ShareGPT dataset of `pdkv bench serve --dataset sharegpt --dataset-path FILE` (vLLM's
`ShareGPTDataset`, from a local JSON file; nothing is downloaded).

File format (ShareGPT_V3_unfiltered_cleaned_split.json): a JSON list of
`{"conversations": [{"from": "human", "value": str}, {"from": "gpt", "value": str}, ...]}`.
Each entry with at least two turns gives one sample: prompt = the first turn's text, output
length = the token count of the second turn (or `output_len` when given). Entries are taken in
a seeded random order; as in vLLM's `is_valid_sequence`, a sample is skipped when its prompt
has fewer than 4 tokens, its output too (unless output_len is fixed), its prompt more than 1024,
or prompt + output more than 2048.
"""

from __future__ import annotations

import json

import numpy as np

from pdkv.bench.serve.datasets import PromptTokenizer
from pdkv.bench.serve.records import SampleRequest
from pdkv.jsontypes import JSONValue

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


def load_pairs(path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) texts of every entry with two or more turns.

    Raises:
        ValueError: the file is not a JSON list of conversations, or none has two turns.
    """
    with open(path) as f:
        try:
            data: JSONValue = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}: not JSON ({e}); expected ShareGPT's list of conversations"
            ) from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of {{\"conversations\": [...]}}")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if isinstance(first, dict) and isinstance(second, dict):
            pairs.append((str(first.get("value", "")), str(second.get("value", ""))))
    if not pairs:
        raise ValueError(f"{path}: no conversation with two turns")
    return pairs


async def sharegpt_dataset(tok: PromptTokenizer, path: str, num_prompts: int, seed: int,
                           output_len: int | None = None) -> list[SampleRequest]:
    """Up to `num_prompts` samples from the ShareGPT file at `path` (see the module doc),
    prompt lengths measured with `tok`.

    Raises:
        ValueError: bad file (see load_pairs), or no entry passes the length filters.
    """
    pairs = load_pairs(path)
    order = np.random.default_rng(seed).permutation(len(pairs))
    samples: list[SampleRequest] = []
    for i in order:
        if len(samples) >= num_prompts:
            break
        prompt, completion = pairs[int(i)]
        prompt_len = len(await tok.encode(prompt))
        out_len = output_len if output_len is not None else len(await tok.encode(completion))
        if prompt_len < MIN_LEN or (output_len is None and out_len < MIN_LEN):
            continue
        if prompt_len > MAX_PROMPT_LEN or prompt_len + out_len > MAX_TOTAL_LEN:
            continue
        samples.append(SampleRequest(prompt, prompt_len, out_len))
    if not samples:
        raise ValueError(f"{path}: no conversation passes the length filters (prompt and output >= "
                         f"{MIN_LEN} tokens, prompt <= {MAX_PROMPT_LEN}, total <= {MAX_TOTAL_LEN})")
    return samples
