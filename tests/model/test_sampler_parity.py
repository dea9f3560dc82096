"""Sampler parity on fixed logits: the batched penalties, logit_bias, min_tokens mask and min_p
against a brute-force per-token reference written from vLLM's definitions (no model, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from pdkv.model.sampler import SamplingRow, _random_logits, logprob_entry, process_logits, sample
from pdkv.sampling_params import SamplingParams

VOCAB = 50


def _reference(logits: list[float], row: SamplingRow) -> list[float]:
    """One row, one token at a time: logit_bias, mask, repetition (prompt + output), frequency
    (each output occurrence), presence (each distinct output token)."""
    p = row.params
    x = list(logits)
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in row.mask_token_ids:
        x[t] = -math.inf
    ids = row.token_ids or []
    prompt, output = ids[: row.num_prompt_tokens], ids[row.num_prompt_tokens:]
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in output:
        x[t] -= p.frequency_penalty
    for t in set(output):
        x[t] -= p.presence_penalty
    return x


def _rows() -> list[SamplingRow]:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    output = torch.randint(0, VOCAB, (9,), generator=gen).tolist() + [prompt[0]] * 3
    both = prompt + output
    return [
        SamplingRow(SamplingParams(temperature=0), None, (), both, len(prompt)),
        SamplingRow(
            SamplingParams(temperature=0, repetition_penalty=1.7), None, (), both, len(prompt)
        ),
        SamplingRow(
            SamplingParams(temperature=0, frequency_penalty=1.3), None, (), both, len(prompt)
        ),
        SamplingRow(
            SamplingParams(temperature=0, presence_penalty=-0.8), None, (3, 7), both, len(prompt)
        ),
        SamplingRow(
            SamplingParams(
                temperature=0,
                repetition_penalty=0.6,
                frequency_penalty=-2.0,
                presence_penalty=2.0,
                logit_bias={1: 5.0, 2: -300.0},
            ),
            None,
            (),
            both[:15],
            12,
        ),
        SamplingRow(SamplingParams(temperature=0, logit_bias={4: 100.0}), None, (), [5, 6], 2),
    ]


def test_penalties_bias_and_mask_match_reference():
    rows = _rows()
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    got = process_logits(logits, rows)
    for i, row in enumerate(rows):
        want = torch.tensor(_reference(logits[i].tolist(), row))
        assert torch.allclose(got[i], want, atol=1e-5), f"row {i}: {row.params}"
    assert torch.equal(got[0], logits[0])  # no option: untouched
    assert not torch.equal(got[2], logits[2])  # frequency_penalty changed the row
    # logit_bias is clamped to [-100, 100] (OpenAI's range); token 4 wins row 5.
    assert rows[4].params.logit_bias == {1: 5.0, 2: -100.0}
    tokens, _ = sample(logits, rows)
    assert tokens == [
        int(torch.tensor(_reference(logits[i].tolist(), r)).argmax()) for i, r in enumerate(rows)
    ]
    assert tokens[5] == 4


def test_min_p_keeps_tokens_above_fraction_of_top():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(temperature=1.3),
              SamplingParams(temperature=1.0, min_p=0.5, top_k=3)]
    got = _random_logits(logits.clone(), params)
    for i, p in enumerate(params):
        probs = (logits[i] / p.temperature).softmax(-1).tolist()
        top = max(probs)
        keep = {t for t, q in enumerate(probs) if q >= p.min_p * top}
        if p.top_k:
            keep &= set(torch.topk(logits[i], p.top_k).indices.tolist())
        assert {t for t in range(VOCAB) if math.isfinite(got[i, t])} == keep
    # A draw never picks a token min_p dropped.
    gen = torch.Generator().manual_seed(3)
    row = SamplingRow(params[0], gen, ())
    allowed = {t for t in range(VOCAB) if math.isfinite(got[0, t])}
    drawn = {sample(logits[:1], [row])[0][0] for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_logprob_rank():
    lp = torch.log_softmax(torch.tensor([0.0, 3.0, 1.0, 2.0]), -1)
    entry = logprob_entry(lp, 2, 2)
    assert [(t, r) for t, _, r in entry] == [(2, 3), (1, 1), (3, 2)]
    assert entry[0][1] == pytest.approx(float(lp[2]))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"n": 0}, "n must be at least 1"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be non-negative"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"3": math.nan}}, "logit_bias"),
])
def test_new_fields_validated_like_vllm(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_child_params_seed_offsets():
    p = SamplingParams(n=3, seed=7, logit_bias={"5": 200})
    assert p.logit_bias == {5: 100.0}
    assert [c.seed for c in (p.child(0), p.child(1), p.child(2))] == [7, 8, 9]
    assert p.child(1).n == 1 and SamplingParams(n=2).child(1).seed is None


class _CountHostReads(torch.overrides.TorchFunctionMode):
    """Counts device -> host reads (tolist, item, int, float, bool) made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in (
            "tolist",
            "item",
            "__int__",
            "__float__",
            "__bool__",
            "__index__",
            "cpu",
            "numpy",
        ):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_sampling_keeps_ids_on_device_and_copies_once():
    """Greedy, random (with top_p / min_p / top_k) and logprob rows: sample_tensors reads nothing
    back from the device; to_host makes exactly one copy; the result is what the per-row
    reference (argmax, the same generator's draw, logprob_entry) gives."""
    from pdkv.model.host_sync import HostSyncGuard
    from pdkv.model.sampler import sample_tensors

    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, min_p=0.05, top_k=5, logprobs=0),
        SamplingParams(temperature=0, logprobs=3, frequency_penalty=0.5),
    ]

    def rows() -> list[SamplingRow]:
        return [
            SamplingRow(
                p, None if p.greedy else torch.Generator().manual_seed(10 + i), (), [1, 2, 3], 2
            )
            for i, p in enumerate(params)
        ]

    with HostSyncGuard(allow_host_to_device=True):
        out = sample_tensors(logits, rows())
    counter = _CountHostReads()
    with counter:
        tokens, entries = out.to_host()
    assert counter.calls == ["tolist"]
    assert entries is not None and [len(e) for e in entries] == [3, 0, 0, 1, 4]
    x = process_logits(logits, rows())
    want_rows = rows()
    raw = torch.log_softmax(logits, -1)
    for i, p in enumerate(params):
        if p.greedy:
            assert tokens[i] == int(x[i].argmax())
        else:
            probs = _random_logits(x[i : i + 1], [p]).softmax(-1)
            assert tokens[i] == int(
                torch.multinomial(probs[0], 1, generator=want_rows[i].generator)
            )
        if p.logprobs is not None:
            lp = raw[i, tokens[i]]
            top = torch.topk(raw[i], p.logprobs) if p.logprobs else None
            want = [(tokens[i], float(lp), int((raw[i] > lp).sum()) + 1)]
            if top is not None:
                want += [
                    (int(t), float(v), r + 1)
                    for r, (t, v) in enumerate(zip(top.indices, top.values))
                ]
            assert entries[i] == want
