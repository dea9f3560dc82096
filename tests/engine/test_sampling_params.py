"""SamplingParams range checks (torch-free, fast): every out-of-range value raises ValueError
naming the field, and the limits themselves are accepted."""

from __future__ import annotations

import math

import pytest

from pdkv.sampling_params import MAX_STOP, SEED_MAX, SEED_MIN, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": SEED_MAX + 1}, "seed"),
        ({"seed": SEED_MIN - 1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"stop": ["x"] * (MAX_STOP + 1)}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [1] * (MAX_STOP + 1)}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_out_of_range_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seed": SEED_MAX},
        {"seed": SEED_MIN},
        {"seed": -1},
        {"temperature": 0},
        {"temperature": 1e6},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 10**9},
        {"logprobs": 0},
        {"stop": ["x"] * MAX_STOP},
        {"stop_token_ids": list(range(MAX_STOP))},
        {"include_stop_str_in_output": True},
    ],
)
def test_limits_are_accepted(kwargs):
    SamplingParams(**kwargs)
