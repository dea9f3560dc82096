"""Offline API, compatible with vLLM's `LLM`: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pdkv.engine.arg_utils import EngineArgs
from pdkv.engine.llm_engine import LLMEngine, PromptType
from pdkv.outputs import RequestOutput
from pdkv.sampling_params import SamplingParams

ChatMessages = list[dict[str, str]]


def merge_children(outs: list[RequestOutput], sizes: list[int]) -> list[RequestOutput]:
    """Group consecutive outputs (`sizes[k]` of them for prompt k) into one RequestOutput per
    prompt with outputs indexed 0 .. n-1 (the first child's id and metrics)."""
    merged, at = [], 0
    for size in sizes:
        group = outs[at : at + size]
        at += size
        first = group[0]
        comps = []
        for i, out in enumerate(group):
            comp = out.outputs[0]
            comp.index = i
            comps.append(comp)
        first.outputs = comps
        first.finished = all(o.finished for o in group)
        merged.append(first)
    return merged


class LLM:
    """Generate completions for a batch of prompts with continuous batching.

    Keyword arguments are EngineArgs fields (model="smollm2", block_size=16,
    enable_prefix_caching=True, max_num_seqs, max_num_batched_tokens, num_kv_blocks,
    max_model_len, dtype, device, seed, ...), with vLLM's names: gpu_memory_utilization (the
    KV cache is that fraction of the memory free after loading the weights: free device
    memory on a GPU, available RAM on the CPU; ignored when num_kv_blocks is given),
    kv_cache_dtype ("auto"), enforce_eager (no CUDA graphs for decode steps; the CPU is always
    eager).

    Raises:
        ValueError: unknown model or bad engine option.
    """

    def __init__(self, model: str = "smollm2", **kwargs: Any) -> None:
        args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)

    def get_tokenizer(self) -> Any:
        """The transformers tokenizer of the model."""
        return self.llm_engine.tokenizer.hf

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs are in prompt order.

        Args:
            prompts: a string, {"prompt_token_ids": [...]}, or a list of those.
            sampling_params: one for all prompts or one per prompt (default SamplingParams()).
            use_tqdm: show a progress bar (tqdm, on stderr), as vLLM does by default.
            cache_salt: prefix-cache salt applied to every prompt.

        Raises:
            ValueError: any invalid prompt or params; then no prompt of the batch is queued.
        """
        if isinstance(prompts, (str, dict)):
            prompt_list: list[PromptType] = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            raise ValueError(f"unsupported prompt type {type(prompts).__name__}")
        elif prompts and all(isinstance(t, int) for t in prompts):
            prompt_list = [list(prompts)]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        engine = self.llm_engine
        # n > 1: one engine request per sequence (they share the prompt's blocks through the
        # prefix cache), merged back into one RequestOutput per prompt.
        made = [
            [engine.make_request(p, sp.child(i), cache_salt=cache_salt) for i in range(sp.n)]
            for p, sp in zip(prompt_list, params_list)
        ]
        for group in made:
            for request, text in group:
                engine.add_request(request, text)
        outs = self._run([r.request_id for group in made for r, _ in group], use_tqdm)
        return merge_children(outs, [len(group) for group in made])

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render conversations with the model's chat template, then generate.

        Args:
            messages: one conversation ([{"role", "content"}, ...]) or a list of them.
        """
        convs: list[ChatMessages] = (
            [messages]  # type: ignore[list-item]
            if messages and isinstance(messages[0], dict)
            else list(messages)  # type: ignore[arg-type]
        )
        tok = self.llm_engine.tokenizer
        prompts: list[PromptType] = [
            {"prompt_token_ids": tok.encode_chat(c, add_generation_prompt),
             "prompt": tok.apply_chat_template(c, add_generation_prompt)}
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget the engine's prefix cache (vLLM's `LLM.reset_prefix_cache`): the next
        identical prompt is computed again. Between generate calls no block is in use, so this
        returns True; False means blocks were still held (nothing was changed)."""
        return self.llm_engine.reset_prefix_cache()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                outs = engine.step()
                if not outs and engine.last_num_scheduled_tokens == 0:
                    time.sleep(0.001)  # waiting for KV transfers only
                for out in outs:
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[r] for r in request_ids]
