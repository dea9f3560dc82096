"""Turns scheduler updates into RequestOutputs: incremental detokenization, stop strings,
logprobs and timings.

As in vLLM, the text of the token that stopped a request (EOS or one of stop_token_ids) and a
matched stop string are left out of the output text unless include_stop_str_in_output; the token
ids always include the stop token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdkv.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pdkv.request import Request, RequestStatus
from pdkv.sched.output import RequestUpdate
from pdkv.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Text deltas for a growing token list, never emitting half a character.

    Uses the prefix/read offset window of HF's TextStreamer and vLLM's
    `detokenize_incrementally`: decode the tail starting a few tokens back and emit what
    grew, holding back while the text ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly completed text (maybe "")."""
        self.token_ids.extend(token_ids)
        prefix = self.tokenizer.decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip
        )
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (called when the request finishes)."""
        prefix = self.tokenizer.decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip
        )
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], self.skip)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix) :]


@dataclass
class _ReqState:
    prompt: str | None
    detok: IncrementalDetokenizer
    stop: tuple[str, ...]
    min_tokens: int
    include_stop: bool
    full_text: str = ""
    emitted: int = 0
    searched: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class OutputProcessor:
    """Owns per-request text state. Called from the engine loop thread."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _ReqState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        p = request.sampling_params
        self._states[request.request_id] = _ReqState(
            prompt=prompt,
            detok=IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens),
            stop=p.stop,
            min_tokens=p.min_tokens,
            include_stop=p.include_stop_str_in_output,
            logprobs=[] if p.logprobs is not None else None,
            cumulative_logprob=0.0 if p.logprobs is not None else None,
        )

    def process(self, update: RequestUpdate) -> tuple[RequestOutput, bool]:
        """Build the RequestOutput of one update.

        Returns:
            (output, hit_stop_string): the second is True when a stop string ended the
            request here (the caller must then finish it in the scheduler).
        """
        req = update.request
        st = self._states[req.request_id]
        st.token_ids.extend(update.new_token_ids)
        if st.logprobs is not None and update.new_logprobs:
            for entry in update.new_logprobs:
                st.logprobs.append(self._logprob_dict(entry))
                st.cumulative_logprob = (st.cumulative_logprob or 0.0) + entry[0][1]
        if update.prompt_logprobs is not None and st.prompt_logprobs is None:
            st.prompt_logprobs = [
                None if e is None else self._logprob_dict(e) for e in update.prompt_logprobs
            ]
        text_ids = update.new_token_ids
        stop_token = update.finished and req.status == RequestStatus.FINISHED_STOPPED
        if stop_token and text_ids and not st.include_stop:
            text_ids = text_ids[:-1]  # the stop token's text is not output (vLLM)
        st.full_text += st.detok.add(text_ids)
        if update.finished:
            st.full_text += st.detok.flush()
        hit_stop = False
        if st.stop and len(st.token_ids) >= st.min_tokens:
            stop_str = self._truncate_at_stop(st)
            if stop_str is not None:
                hit_stop = True
                req.stop_reason = stop_str
        finished = update.finished or hit_stop
        # While running, hold back a possible stop-string prefix so no delta is ever retracted.
        hold = 0 if finished or not st.stop or st.include_stop else max(len(s) for s in st.stop) - 1
        upto = max(st.emitted, len(st.full_text) - hold)
        delta = st.full_text[st.emitted : upto]
        st.emitted = upto
        out = self._make_output(req, st, delta, update.new_token_ids, finished, hit_stop)
        if finished:
            del self._states[req.request_id]
        return out, hit_stop

    def abort(self, request: Request) -> RequestOutput | None:
        """Final output of a request finished from outside (abort)."""
        st = self._states.pop(request.request_id, None)
        if st is None:
            return None
        return self._make_output(request, st, "", [], True, False)

    def _logprob_dict(self, entry: list[tuple[int, float, int]]) -> dict[int, Logprob]:
        """{token_id: Logprob} of one position: the top-N, then the sampled token (vLLM's
        order is by token; ours keeps the top-N order with the sampled token last)."""
        out: dict[int, Logprob] = {}
        for tid, lp, rank in entry[1:] + entry[:1]:
            out[tid] = Logprob(lp, rank, self.tokenizer.decode([tid], skip_special_tokens=False))
        return out

    @staticmethod
    def _truncate_at_stop(st: _ReqState) -> str | None:
        """Cut full_text at the earliest stop string; returns that string or None."""
        longest = max(len(s) for s in st.stop)
        window = max(0, st.searched - longest + 1)
        best: tuple[int, str] | None = None
        for s in st.stop:
            i = st.full_text.find(s, window)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        st.searched = len(st.full_text)
        if best is None:
            return None
        st.full_text = st.full_text[: best[0] + (len(best[1]) if st.include_stop else 0)]
        return best[1]

    def _make_output(
        self,
        req: Request,
        st: _ReqState,
        delta: str,
        delta_ids: list[int],
        finished: bool,
        hit_stop: bool,
    ) -> RequestOutput:
        reason = "stop" if hit_stop else (req.get_finished_reason() if finished else None)
        t = req.times
        if finished and t.finished is None:  # every finish (stop, length, abort, error) has a time
            t.finished = time.monotonic()
        comp = CompletionOutput(
            index=0,
            text=st.full_text[: st.emitted],
            token_ids=list(st.token_ids),
            finish_reason=reason,
            stop_reason=req.stop_reason,
            logprobs=list(st.logprobs) if st.logprobs is not None else None,
            cumulative_logprob=st.cumulative_logprob,
            delta_text=delta,
            delta_token_ids=list(delta_ids),
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[comp],
            finished=finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            kv_load_bytes=dict(req.kv_load_bytes),
            metrics=RequestMetrics(
                arrival_time=t.arrival,
                first_scheduled_time=t.first_scheduled,
                first_token_time=t.first_token,
                last_token_time=t.last_token,
                finished_time=t.finished,
                num_preemptions=req.num_preemptions,
                num_output_tokens=len(st.token_ids),
                kv_wait_time=t.kv_wait,
                num_external_tokens=req.num_external_tokens,
                max_tokens_param=req.sampling_params.max_tokens,
            ),
            kv_transfer_params=req.output_kv_transfer_params if finished else None,
            error=req.error if finished else None,
            prompt_logprobs=st.prompt_logprobs,
        )
