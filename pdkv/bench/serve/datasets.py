"""Prompts for `pdkv bench serve`: random, prefix-repetition, multi-turn (optionally opening with
one of a few shared system prompts) and jsonl datasets.

Token counts come from the server's own tokenizer when it has one: random token ids in
[100, vocab_size) (ids < 100 are left out as likely special tokens) are turned into text with
`POST /detokenize`, and the text is re-measured with `POST /tokenize` (vLLM and pdkv both serve
these: `{"model", "prompt"} -> {"tokens", "count"}` and `{"model", "tokens"} -> {"prompt"}`).
Because decode -> encode does not always round-trip, the token list is trimmed or topped up
and re-decoded a few times until the count matches; the measured count is kept as prompt_len.
Without `/tokenize`, `WordTokenizer` stands in: one common English word per "token".

Lengths: each request's input/output length is drawn uniformly from the integers in
[floor(len * (1 - r)), ceil(len * (1 + r))] (vLLM's random dataset; at least 1).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from typing import Protocol

import httpx
import numpy as np

from pdkv.bench.serve.records import SampleRequest

MIN_TOKEN_ID = 100
_FIX_ROUNDS = 4

_WORD_TEXT = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people "
    "my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low "
    "line differ turn cause much mean before move right boy old too same tell does set three "
    "want air well also play small end put home read hand port large spell add even land here "
    "must big high such follow act why ask men change went light kind off need house picture "
    "try us again animal point mother world near build self earth father head stand own page "
    "should country found answer school grow study still learn plant cover food sun four "
    "between state keep eye never last let thought city tree cross farm hard start might story "
    "saw far sea draw left late run while press close night real life few north open seem"
)
_WORDS = tuple(_WORD_TEXT.split())
_WORD_INDEX = {w: i for i, w in enumerate(_WORDS)}


class PromptTokenizer(Protocol):
    """What the dataset builders need: text <-> token ids (async)."""

    name: str

    async def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        ...

    async def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids `ids`."""
        ...


class ServerTokenizer:
    """The server's tokenizer through its `/tokenize` and `/detokenize` endpoints.

    `/tokenize` is asked for `add_special_tokens: false` (as vLLM's own benchmark does), so a
    BOS token the server adds to every prompt is not part of the measured length; a server
    that rejects the field (HTTP 400/422) is asked without it.
    """

    name = "server"

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str,
                 headers: dict[str, str] | None = None, max_parallel: int = 32):
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = headers or {}
        self.no_special_tokens = True
        self._sem = asyncio.Semaphore(max_parallel)

    async def encode(self, text: str) -> list[int]:
        """POST /tokenize; returns the token ids."""
        body: dict[str, object] = {"model": self.model, "prompt": text}
        if self.no_special_tokens:
            body["add_special_tokens"] = False
        async with self._sem:
            r = await self.client.post(f"{self.base_url}/tokenize", headers=self.headers,
                                       json=body)
            if r.status_code in (400, 422) and self.no_special_tokens:
                self.no_special_tokens = False
                del body["add_special_tokens"]
                r = await self.client.post(f"{self.base_url}/tokenize", headers=self.headers,
                                           json=body)
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    async def decode(self, ids: Sequence[int]) -> str:
        """POST /detokenize; returns the text."""
        async with self._sem:
            r = await self.client.post(f"{self.base_url}/detokenize", headers=self.headers,
                                       json={"model": self.model, "tokens": [int(i) for i in ids]})
        r.raise_for_status()
        return str(r.json()["prompt"])


class WordTokenizer:
    """Fallback when the server has no `/tokenize`: token id i <-> common English word i % N.

    One word is roughly one token for English BPE vocabularies, so lengths are approximate.
    """

    name = "words"

    async def encode(self, text: str) -> list[int]:
        """One id per whitespace-separated word (known words keep their index)."""
        return [_WORD_INDEX.get(w, len(_WORDS) + len(w)) for w in text.split()]

    async def decode(self, ids: Sequence[int]) -> str:
        """Words for ids, joined by spaces."""
        return " ".join(_WORDS[int(i) % len(_WORDS)] for i in ids)


async def server_tokenizer_or_words(
    client: httpx.AsyncClient, base_url: str, model: str, headers: dict[str, str] | None = None
) -> PromptTokenizer:
    """`ServerTokenizer` if a probe `/tokenize` + `/detokenize` works, else `WordTokenizer`."""
    tok = ServerTokenizer(client, base_url, model, headers)
    try:
        ids = await tok.encode("Hello world, this is a tokenizer probe.")
        await tok.decode(ids)
        if not ids:
            raise ValueError("empty token list")
        return tok
    except (httpx.HTTPError, ValueError, KeyError, TypeError, json.JSONDecodeError):
        return WordTokenizer()


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    """n lengths uniform over the integers in [floor(length*(1-r)), ceil(length*(1+r))], >= 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    """n token ids uniform in [100, vocab_size)."""
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"--vocab-size must be > {MIN_TOKEN_ID}, got {vocab_size}")
    return [int(x) for x in rng.integers(MIN_TOKEN_ID, vocab_size, size=n)]


async def ids_to_prompt(tok: PromptTokenizer, ids: list[int], target_len: int,
                        rng: np.random.Generator, vocab_size: int) -> tuple[str, int]:
    """Decode `ids` to text whose re-encoded length is `target_len` when reachable.

    Returns:
        (text, measured token count of text).
    """
    text = await tok.decode(ids)
    toks = await tok.encode(text)
    for _ in range(_FIX_ROUNDS):
        if len(toks) == target_len:
            break
        if len(toks) > target_len:
            toks = toks[:target_len]
        else:
            toks = toks + random_ids(rng, target_len - len(toks), vocab_size)
        text = await tok.decode(toks)
        toks = await tok.encode(text)
    return text, len(toks)


async def random_dataset(tok: PromptTokenizer, num_prompts: int, input_len: int,
                         output_len: int, range_ratio: float, vocab_size: int,
                         seed: int) -> list[SampleRequest]:
    """Random-token prompts of ~input_len tokens each (see the module doc)."""
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    id_lists = [random_ids(rng, n, vocab_size) for n in in_lens]
    fix_rngs = [np.random.default_rng([seed, i]) for i in range(num_prompts)]
    made = await asyncio.gather(*[ids_to_prompt(tok, ids, n, r, vocab_size)
                                  for ids, n, r in zip(id_lists, in_lens, fix_rngs)])
    return [SampleRequest(text, n, o) for (text, n), o in zip(made, out_lens)]


async def prefix_repetition_dataset(tok: PromptTokenizer, num_prompts: int, prefix_len: int,
                                    input_len: int, output_len: int, num_prefixes: int,
                                    range_ratio: float, vocab_size: int,
                                    seed: int) -> list[SampleRequest]:
    """Prompts = one of `num_prefixes` shared prefixes (prefix_len tokens) + a random suffix.

    Suffix lengths (input_len tokens) and output lengths vary by range_ratio; prefixes do not.
    Prompt i uses prefix i % num_prefixes; the order is then shuffled (seeded), as in vLLM's
    prefix_repetition dataset. Each prompt is decoded from prefix ids + suffix ids in one go,
    so the prefix text is identical across the prompts that share it.
    """
    if num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    prefixes = [random_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    suf_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    id_lists = [prefixes[i % num_prefixes] + random_ids(rng, n, vocab_size)
                for i, n in enumerate(suf_lens)]
    targets = [prefix_len + n for n in suf_lens]
    fix_rngs = [np.random.default_rng([seed, i]) for i in range(num_prompts)]
    made = await asyncio.gather(*[ids_to_prompt(tok, ids, n, r, vocab_size)
                                  for ids, n, r in zip(id_lists, targets, fix_rngs)])
    samples = [SampleRequest(text, n, o) for (text, n), o in zip(made, out_lens)]
    order = rng.permutation(len(samples))
    return [samples[int(i)] for i in order]


def transcript(messages: Sequence[dict[str, str]]) -> str:
    """A conversation as one completions prompt: "User: ...\n\nAssistant: ...\n\n...Assistant:"
    (ends with the assistant's cue when the last message is the user's)."""
    names = {"user": "User", "assistant": "Assistant", "system": "System"}
    text = "\n\n".join(f"{names.get(m['role'], m['role'])}: {m['content']}" for m in messages)
    return text + ("\n\nAssistant:" if messages and messages[-1]["role"] == "user" else "")


async def multi_turn_dataset(tok: PromptTokenizer, num_conversations: int, num_turns: int,
                             input_len: int, output_len: int, vocab_size: int,
                             seed: int, prefix_len: int = 0,
                             num_prefixes: int = 1) -> list[SampleRequest]:
    """`num_conversations` conversations of `num_turns` turns each; turn t's prompt is the turns
    before it (question and answer each) plus a new question, so each turn's prompt extends the
    previous turn's.

    Questions are random text of ~input_len tokens, answers of ~output_len tokens; the answers
    in later prompts are these synthetic ones, not the model's outputs, so every prompt is fixed
    before the run. Order: turn-major — turn 0 of every conversation, then turn 1 of every
    conversation, ... (users taking turns); with --max-concurrency 1 the requests go one at a time
    in this order, so a router sees the same sequence every run. Each sample carries its chat
    `messages`; its `prompt` is their `transcript` (completions endpoint).

    With `prefix_len` > 0 every conversation opens with a system message of ~prefix_len tokens,
    one of `num_prefixes` distinct ones: conversation c gets system prompt c % num_prefixes, so
    the conversations sharing a system prompt (a group of users) share that prompt prefix and the
    groups alternate in the turn-major order. The system prompts are drawn from their own seeded
    stream, so the questions and answers are the same as without them; `prefix_len` 0 (the
    default) gives exactly the conversations of earlier versions.

    Raises:
        ValueError: fewer than 1 conversation, turn or prefix, or prefix_len < 0.
    """
    if num_conversations < 1 or num_turns < 1:
        raise ValueError(
            f"multi-turn needs >= 1 conversation and turn, got {num_conversations} x {num_turns}"
        )
    if prefix_len < 0 or num_prefixes < 1:
        raise ValueError(
            f"multi-turn system prompts need prefix_len >= 0 and num_prefixes >= 1, got "
            f"{prefix_len} and {num_prefixes}"
        )
    rng = np.random.default_rng(seed)
    pieces = [[(random_ids(rng, input_len, vocab_size), random_ids(rng, output_len, vocab_size))
               for _ in range(num_turns)] for _ in range(num_conversations)]
    fix = np.random.default_rng([seed, 2])

    async def text(ids: list[int], fix: np.random.Generator = fix) -> str:
        return (await ids_to_prompt(tok, ids, len(ids), fix, vocab_size))[0].strip()

    qa = [[(await text(q), await text(a)) for q, a in conv] for conv in pieces]
    systems: list[str] = []
    if prefix_len > 0:
        sys_rng, sys_fix = np.random.default_rng([seed, 3]), np.random.default_rng([seed, 4])
        systems = [await text(random_ids(sys_rng, prefix_len, vocab_size), sys_fix)
                   for _ in range(num_prefixes)]
    samples = []
    for t in range(num_turns):
        for c, conv in enumerate(qa):
            messages: list[dict[str, str]] = []
            if systems:
                messages.append({"role": "system", "content": systems[c % len(systems)]})
            for q, a in conv[:t]:
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            messages.append({"role": "user", "content": conv[t][0]})
            prompt = transcript(messages)
            samples.append(
                SampleRequest(prompt, len(await tok.encode(prompt)), output_len, messages)
            )
    return samples


async def jsonl_dataset(tok: PromptTokenizer, path: str, num_prompts: int,
                        output_len: int) -> list[SampleRequest]:
    """The first `num_prompts` lines of a jsonl file: {"prompt": str, "output_len": int?}.

    Lines without "output_len" use `output_len`; prompt_len is measured with `tok`.
    """
    rows: list[tuple[str, int]] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(rows) >= num_prompts:
                break
            obj = json.loads(line)
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": str, ...}}")
            rows.append((obj["prompt"], int(obj.get("output_len") or output_len)))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    lens = await asyncio.gather(*[tok.encode(p) for p, _ in rows])
    return [SampleRequest(p, len(ids), o) for (p, o), ids in zip(rows, lens)]
