"""The soak's workload (torch-free): a finite set of request shapes (items) drawn from a seeded
stream of requests, their OpenAI bodies, the text of an answer, and where a greedy answer leaves
its reference.

Greedy requests (temperature 0) are compared with a reference made by the colocated engine on an
idle box, one request at a time, before the load starts. Float32 results depend slightly on the
batch a request runs in (other matrix shapes, other summation orders), so a greedy answer may take
the second-best token where the two best are within rounding of each other. `divergence` finds
the first token where an answer leaves its reference and the reference's gap between its best two
log-probabilities there; the soak excuses a divergence only at a near tie (gap below a margin) and
counts it apart.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import dataclass

from pdkv.bench.chaos.load import WORDS
from pdkv.jsontypes import JSONObject, JSONValue

CHOICES = ("red", "green", "blue", "yellow")
JSON_SCHEMA: JSONObject = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": list(CHOICES)}},
    "required": ["colour"],
    "additionalProperties": False,
}
TARGETS = ("pd", "colocated")


@dataclass(frozen=True)
class Item:
    """One request shape of the soak.

    Attributes:
        key: a name unique within the item set (the reference's key).
        api: "chat" or "completions".
        prompt: the completion prompt, or the user message of a chat.
        max_tokens: output budget (tokens).
        structured: "" (free text), "choice" (guided_choice over CHOICES) or "json"
            (response_format json_schema JSON_SCHEMA).
    """

    key: str
    api: str
    prompt: str
    max_tokens: int
    structured: str = ""


@dataclass(frozen=True)
class SoakRequest:
    """One request to send.

    Attributes:
        item: its shape.
        target: "pd" (the P/D proxy) or "colocated" (the colocated proxy).
        stream: streamed or not.
        greedy: temperature 0 (compared with the item's reference) or sampled (temperature 0.8,
            top_p 0.95, `seed`).
        n: choices asked for (> 1 only on the colocated target: P/D serves n = 1).
        seed: the sampling seed (sampled requests).
        cancel_after: seconds after sending at which the client gives up (None: never).
    """

    item: Item
    target: str
    stream: bool
    greedy: bool
    n: int = 1
    seed: int | None = None
    cancel_after: float | None = None


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def make_items(seed: int, count: int, long_fraction: float, long_words: int,
               max_tokens: int) -> list[Item]:
    """`count` request shapes from `seed`: chat and completions alternately, short prompts (8-60
    words) and `long_fraction` long ones (a shared prefix of `long_words` * 3/4 words, then a
    distinct tail: their first chunks are common, so the prefix cache and the pool serve them),
    outputs of 4..max_tokens tokens, and every sixth item structured (choice / json alternately).

    Raises:
        ValueError: count < 1, max_tokens < 4 or long_words < 8.
    """
    if count < 1 or max_tokens < 4 or long_words < 8:
        raise ValueError("need count >= 1, max_tokens >= 4 and long_words >= 8")
    rng = random.Random(seed)
    shared = _words(rng, long_words * 3 // 4)
    items = []
    for i in range(count):
        api = "chat" if i % 2 else "completions"
        structured = ("choice", "json")[(i // 6) % 2] if i % 6 == 5 else ""
        if rng.random() < long_fraction:
            prompt = shared + " " + _words(rng, long_words - long_words * 3 // 4)
        else:
            prompt = _words(rng, rng.randint(8, 60))
        if structured:
            prompt = f"Name one colour ({', '.join(CHOICES)}) for: {prompt}"
        items.append(Item(f"{i}-{api}{'-' + structured if structured else ''}", api, prompt,
                          rng.randint(4, max_tokens), structured))
    return items


def next_request(rng: random.Random, items: list[Item], cancel_fraction: float,
                 sampled_fraction: float, max_cancel_s: float) -> SoakRequest:
    """The next request of the stream `rng` drives: an item, a target (half each), streamed or not
    (half each), greedy or sampled, n in 1..3 for sampled requests to the colocated target, and a
    client cancel at uniform(0.05, max_cancel_s) s for `cancel_fraction` of them."""
    item = rng.choice(items)
    target = rng.choice(TARGETS)
    stream = rng.random() < 0.5
    greedy = rng.random() >= sampled_fraction
    n = 1 if greedy or target != "colocated" else rng.randint(1, 3)
    seed = None if greedy else rng.randrange(1 << 30)
    cancel = rng.uniform(0.05, max_cancel_s) if rng.random() < cancel_fraction else None
    return SoakRequest(item, target, stream, greedy, n, seed, cancel)


def request_body(req: SoakRequest, model: str, reference: bool = False) -> JSONObject:
    """The OpenAI body of `req`; `reference` asks for the two best log-probabilities per output
    token (what `token_gaps` reads), not streamed."""
    item = req.item
    body: JSONObject = {"model": model, "max_tokens": item.max_tokens, "n": req.n,
                        "stream": req.stream and not reference}
    if item.api == "chat":
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    if req.greedy:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=req.seed)
    if item.structured == "choice":
        body["guided_choice"] = list(CHOICES)
    elif item.structured == "json":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "colour", "schema": JSON_SCHEMA}}
    if reference:
        if item.api == "chat":
            body.update(logprobs=True, top_logprobs=2)
        else:
            body["logprobs"] = 2
    if body["stream"] and zlib.crc32(item.key.encode()) % 2 == 0:  # half the items, fixed
        body["stream_options"] = {"include_usage": True}
    return body


def choice_text(api: str, choice: JSONObject, delta: bool) -> str:
    """The text of one choice of an answer (`delta`: of one stream chunk)."""
    if api == "chat":
        part = choice.get("delta" if delta else "message")
        content = part.get("content") if isinstance(part, dict) else None
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


class Answer:
    """An answer's texts and finish reasons by choice index, from a whole response or from its
    stream chunks (`add_chunk`, one decoded `data:` object at a time)."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.texts: dict[int, str] = {}
        self.finish: dict[int, str | None] = {}
        self.error = ""

    def add_response(self, data: JSONObject) -> None:
        """A whole (non-streamed) response."""
        self._choices(data, delta=False)

    def add_chunk(self, data: JSONObject) -> None:
        """One stream chunk; an `error` object is recorded (the stream failed)."""
        if "error" in data:
            self.error = json.dumps(data["error"])[:300]
            return
        self._choices(data, delta=True)

    def _choices(self, data: JSONObject, delta: bool) -> None:
        choices = data.get("choices")
        for c in choices if isinstance(choices, list) else []:
            if not isinstance(c, dict):
                continue
            index = c.get("index", 0)
            i = index if isinstance(index, int) else 0
            self.texts[i] = self.texts.get(i, "") + choice_text(self.api, c, delta)
            reason = c.get("finish_reason")
            if isinstance(reason, str) or i not in self.finish:
                self.finish[i] = reason if isinstance(reason, str) else None


def token_gaps(api: str, data: JSONObject) -> list[tuple[str, float]]:
    """(token text, best minus second-best log-probability) of each output token of a whole
    response asked with `request_body(..., reference=True)`; the gap is inf when only one
    candidate came back.

    Raises:
        ValueError: the response carries no log-probabilities.
    """
    choices = _list(data.get("choices"))
    logprobs = _obj(_obj(choices[0] if choices else None).get("logprobs"))
    if not logprobs:
        raise ValueError("the reference response has no logprobs")
    out: list[tuple[str, float]] = []
    if api == "chat":
        for entry in map(_obj, _list(logprobs.get("content"))):
            lps = [_obj(t).get("logprob") for t in _list(entry.get("top_logprobs"))]
            out.append((str(entry.get("token", "")), _gap(lps)))
        return out
    tops = _list(logprobs.get("top_logprobs"))
    for token, top in zip(_list(logprobs.get("tokens")), tops):
        out.append((str(token), _gap(list(_obj(top).values()))))
    return out


def _obj(v: JSONValue) -> JSONObject:
    return v if isinstance(v, dict) else {}


def _list(v: JSONValue) -> list[JSONValue]:
    return v if isinstance(v, list) else []


def _gap(values: list[JSONValue]) -> float:
    """Best minus second-best of the numbers in `values` (inf with fewer than two)."""
    nums = sorted((float(v) for v in values if isinstance(v, (int, float))), reverse=True)
    return nums[0] - nums[1] if len(nums) >= 2 else math.inf


@dataclass(frozen=True)
class Divergence:
    """Where an answer leaves its reference: the reference token's index and the reference's gap
    between its best two log-probabilities at that token (nats)."""

    token: int
    gap: float


def divergence(reference: str, tokens: list[tuple[str, float]], got: str) -> Divergence | None:
    """None when `got` equals `reference`; else the first reference token not wholly inside
    their common prefix (its index may be len(tokens) when `got` runs past the reference).

    `tokens` are the reference's (text, gap) pairs (`token_gaps`); their texts concatenate to
    `reference` (byte-level tokens of ASCII text), so character offsets map to tokens."""
    if got == reference:
        return None
    common = 0
    for a, b in zip(reference, got):
        if a != b:
            break
        common += 1
    end = 0
    for i, (text, gap) in enumerate(tokens):
        end += len(text)
        if end > common:
            return Divergence(i, gap)
    return Divergence(len(tokens), math.inf)


def structured_ok(item: Item, text: str, finish: str | None) -> bool:
    """Whether a finished structured answer obeys its grammar (a cut-off one, finish "length",
    is only checked for being a prefix of a valid answer where that is cheap: choices)."""
    if item.structured == "choice":
        return text in CHOICES if finish == "stop" else any(c.startswith(text) for c in CHOICES)
    if item.structured == "json" and finish == "stop":
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, dict) and value.get("colour") in CHOICES and len(value) == 1
    return True
