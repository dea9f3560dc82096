"""Structured output with llguidance (https://github.com/guidance-ai/llguidance): a grammar per
request (JSON schema, regex, choice, Lark/GBNF) tracked by an `LLMatcher`; each step the
matchers' allowed-token bitmasks mask the logits of their rows (batched), and the sampled token
advances the matcher. As vLLM's "guidance" backend: the grammar allows EOS once it is complete.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from pdkv.sampling_params import StructuredOutputsParams


def compile_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params`.

    Raises:
        ValueError: the schema / regex / grammar is invalid (the message says why).
    """
    import llguidance
    from llguidance import LLMatcher

    try:
        if params.json is not None:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            grammar = LLMatcher.grammar_from_json_schema(schema)
        elif params.json_object:
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"})
        elif params.regex is not None:
            grammar = LLMatcher.grammar_from_regex(params.regex)
        elif params.choice is not None:
            grammar = llguidance.grammar_from("choice", list(params.choice))  # type: ignore[arg-type]
        else:
            assert params.grammar is not None
            grammar = llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as e:
        raise ValueError(f"structured output grammar is invalid: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"structured output grammar is invalid: {error}")
    return grammar


class GrammarMatchers:
    """Makes LLMatchers for one model's tokenizer (built once, on first use: about 1 s).

    Args:
        hf_tokenizer: the model's transformers fast tokenizer.
        vocab_size: the model's logits width (tokens).
        eos_token_id: the token a complete grammar allows.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer: Any = None

    def matcher(self, params: StructuredOutputsParams, output_ids: list[int]) -> Any:
        """A matcher for `params`, advanced over the tokens already generated (a request that
        resumes after preemption).

        Raises:
            ValueError: the grammar is invalid or rejects `output_ids`.
        """
        import llguidance
        import llguidance.hf

        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=self.eos_token_id)
        m = llguidance.LLMatcher(self._tokenizer, compile_grammar(params), log_level=0)
        if output_ids:
            m.consume_tokens(output_ids)
        if m.is_error():
            raise ValueError(f"structured output: {m.get_error()}")
        return m


def apply_grammar_masks(x: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Set to -inf, in place, the logits of x[rows[i]] that matchers[i] does not allow now.

    x: [S, vocab] float32. The bitmasks (32 tokens per int32, llguidance's layout) are
    expanded and applied in one tensor operation."""
    vocab = x.shape[1]
    words = (vocab + 31) // 32
    masks = torch.stack(
        [
            torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)[:words]
            for m in matchers
        ]
    ).to(x.device)
    bits = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = ((masks[:, :, None] >> bits) & 1).reshape(len(rows), -1)[:, :vocab].bool()
    idx = torch.tensor(rows, dtype=torch.long, device=x.device)
    x[idx] = x[idx].masked_fill(~allowed, float("-inf"))
