"""Stop conditions of a request (torch-free), as vLLM's `check_stop`
(vllm/v1/core/sched/utils.py)."""

from __future__ import annotations

from pdkv.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Apply the stop conditions after a token was appended; sets the finished status.

    Order: EOS (unless ignore_eos) and stop_token_ids count only once min_tokens outputs exist;
    then max_tokens and max_model_len cap the length.

    Returns:
        True when the request finished.
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
