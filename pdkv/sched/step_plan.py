"""What one scheduler step has planned so far (torch-free): the token budget left, the prompt
tokens still allowed in a step with decodes (`SchedulerConfig.max_mixed_prefill_tokens`), and the
tokens given to each request."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdkv.config import SchedulerConfig
from pdkv.request import Request
from pdkv.sched.output import CachedRequestData, NewRequestData


@dataclass
class StepPlan:
    """One step's budget and plan.

    Attributes:
        tokens_left: tokens the step may still schedule (starts at max_num_batched_tokens).
        prefill_left: prompt tokens (chunks of more than one token) still allowed, or None when
            the step is not capped (no cap configured, or no running request decodes).
        num_scheduled: tokens per request id, in scheduling order.
    """

    tokens_left: int
    prefill_left: int | None = None
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)

    @staticmethod
    def start(config: SchedulerConfig, running: Iterable[Request]) -> StepPlan:
        """The plan of a new step: the whole budget; the prefill cap applies when some running
        request decodes (has exactly one token left to compute)."""
        cap = config.max_mixed_prefill_tokens
        decodes = bool(cap) and any(r.num_tokens - r.num_computed_tokens == 1 for r in running)
        return StepPlan(config.max_num_batched_tokens, cap if decodes else None)

    def fit(self, wanted: int) -> int:
        """Tokens of a request that wants `wanted` more that fit in this step (0: none)."""
        n = min(wanted, self.tokens_left)
        if wanted > 1 and self.prefill_left is not None:
            n = min(n, self.prefill_left)
        return max(n, 0)

    def spend(self, request_id: str, n: int, prefill: bool) -> None:
        """Record `n` tokens for a request; `prefill`: they are (part of) a prompt chunk."""
        self.num_scheduled[request_id] = n
        self.tokens_left -= n
        if prefill and self.prefill_left is not None:
            self.prefill_left -= n

    def add(self, request: Request, new_block_ids: tuple[list[int], ...],
            block_ids_of: Callable[[str], tuple[list[int], ...]], worker_known: set[str]) -> None:
        """The worker's view of a scheduled request: in full the first time (`worker_known`
        gains its id), else as a delta of the blocks it got this step."""
        req_id = request.request_id
        if req_id in worker_known:
            self.cached_reqs.append(
                CachedRequestData(
                    req_id=req_id,
                    new_block_ids=new_block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
        else:
            worker_known.add(req_id)
            self.new_reqs.append(
                NewRequestData(
                    req_id=req_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=block_ids_of(req_id),
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
