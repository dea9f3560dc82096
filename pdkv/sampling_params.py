"""Sampling parameters, named and defaulted as in vLLM's `SamplingParams`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# A seed must fit a signed 64-bit integer (as vLLM's API checks; torch takes it as int64).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Most stop strings / stop token ids per request.
MAX_STOP = 256


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

    def __post_init__(self) -> None:
        # Accept lists and single strings the way vLLM does, store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        for name in ("max_tokens", "min_tokens", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
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
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or self.logprobs < 0
        ):
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs!r}")
        if len(self.stop) > MAX_STOP or len(self.stop_token_ids) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings and {MAX_STOP} stop_token_ids are allowed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1
