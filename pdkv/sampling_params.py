"""Sampling parameters, named and defaulted as in vLLM's `SamplingParams`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pdkv.jsontypes import JSONValue

_GREEDY_EPS = 1e-5
# A seed must fit a signed 64-bit integer (as vLLM's API checks; torch takes it as int64).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Most stop strings / stop token ids per request.
MAX_STOP = 256


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's `StructuredOutputsParams`); exactly one field
    is set. Compiled and enforced with llguidance (pdkv.model.structured).

    Attributes:
        json: a JSON schema (dict or its JSON text): the output is one JSON value matching it.
            Held as received (a body's guided_json); anything else fails when compiled.
        regex: the output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: a Lark (or GBNF) grammar.
        json_object: True: the output is any JSON object.

    Raises:
        ValueError: none or several of the fields set.
    """

    json: JSONValue = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of strings, got "
                f"{list(self.choice)!r}"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Attributes:
        temperature: 0 means greedy (argmax); must be >= 0.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        seed: per-request seed for reproducible random sampling (None: engine seed + request);
            a signed 64-bit integer.
        max_tokens: most tokens to generate (>= 1).
        min_tokens: EOS and stop_token_ids are masked until this many tokens were generated.
        stop: strings that end generation (at most MAX_STOP); the matched string is not part of
            the output text unless include_stop_str_in_output.
        stop_token_ids: token ids that end generation (besides EOS, unless ignore_eos; at most
            MAX_STOP). The token stays in the output token ids; its text (and EOS's) is not part
            of the output text unless include_stop_str_in_output, as in vLLM.
        ignore_eos: keep generating past EOS.
        logprobs: also return this many top log-probabilities per output token (plus the
            sampled token's); None: none.
        skip_special_tokens: drop special tokens from the output text.
        include_stop_str_in_output: keep the matched stop string, or the text of the stop token
            (stop_token_ids, EOS), in the output text.
        n: number of output sequences for the prompt (>= 1). The engine runs one request per
            sequence; they share the prompt's KV blocks through the prefix cache. With a seed,
            sequence i uses seed + i (as vLLM's parallel sampling).
        presence_penalty: subtracted from the logit of every token already in the output, in
            [-2, 2] (OpenAI / vLLM).
        frequency_penalty: subtracted once per occurrence of a token in the output, in [-2, 2].
        repetition_penalty: divides positive (multiplies negative) logits of tokens in the prompt
            or the output; > 0, 1 disables (CTRL, Keskar et al. 2019, as in vLLM).
        min_p: drop tokens whose probability is below min_p times the top token's, in [0, 1]
            (applied after temperature; random sampling only, like vLLM).
        logit_bias: token id -> value added to its logit before sampling (each value clamped to
            [-100, 100] as OpenAI's API does).
        prompt_logprobs: also return this many top log-probabilities per prompt token (plus the
            prompt token's own); None: none.
        structured_outputs: a grammar the output must follow (StructuredOutputsParams); None.

    Raises:
        ValueError: naming the field and the value when a field is out of range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Accept lists and single strings the way vLLM does, store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", clean_logit_bias(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        for name in ("max_tokens", "min_tokens", "top_k", "n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
            or self.prompt_logprobs < 0
        ):
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs!r}.")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or self.logprobs < 0
        ):
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs!r}")
        if len(self.stop) > MAX_STOP or len(self.stop_token_ids) > MAX_STOP:
            raise ValueError(
                f"at most {MAX_STOP} stop strings and {MAX_STOP} stop_token_ids are allowed"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalty changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def child(self, index: int) -> SamplingParams:
        """The params of sequence `index` of an n > 1 request: n=1, seed + index when seeded
        (vLLM's ParentRequest does the same)."""
        seed = None if self.seed is None else (self.seed + index - SEED_MIN) % 2**64 + SEED_MIN
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def clean_logit_bias(bias: object) -> dict[int, float]:
    """{token id: bias} with int keys (JSON sends strings) and values clamped to [-100, 100];
    SamplingParams applies it to its `logit_bias`, the server to a body's (string keys).

    Raises:
        ValueError: naming logit_bias, for a key that is not an integer or a non-finite value.
    """
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids (integers), got {k!r}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"logit_bias values must be finite numbers, got {v!r} for token {k}")
        if tid < 0:
            raise ValueError(f"logit_bias token id must be >= 0, got {tid}")
        out[tid] = max(-100.0, min(100.0, float(v)))
    return out
