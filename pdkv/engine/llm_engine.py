"""LLMEngine: input validation, then the step loop schedule -> execute -> update."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdkv.config import EngineConfig
from pdkv.engine.arg_utils import EngineArgs
from pdkv.engine.output_processor import OutputProcessor
from pdkv.executor.base import Executor
from pdkv.executor.inproc import InProcExecutor
from pdkv.executor.multiproc import MultiprocExecutor
from pdkv.jsontypes import JSONObject
from pdkv.kv_events.base import KVEventPublisher, create_publisher
from pdkv.kv_events.schema import KVEventBatch
from pdkv.kv_transfer.connector.base import KVConnectorRole
from pdkv.kv_transfer.connector.factory import create_connector
from pdkv.kv_transfer.connector.spec import ConnectorSpec, MultiSpec, PoolSpec, connector_spec
from pdkv.kvpool.events import PoolEventQueue
from pdkv.model.structured import compile_grammar
from pdkv.outputs import RequestOutput
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams
from pdkv.sched.scheduler import Scheduler
from pdkv.tokenizer import Tokenizer
from pdkv.worker.kv_cache import KVCacheSizing

if TYPE_CHECKING:
    from pdkv.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]

# Most top log-probabilities a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class LLMEngine:
    """One engine: tokenizer, scheduler (with its KV cache manager) and the executor that runs
    the model (in this process or on TP/DCP worker processes; pdkv.executor.base.Executor).

    Not thread-safe: the owner calls add_request / abort_request / step from one thread.

    Args:
        config: engine configuration (see EngineArgs.create_engine_config).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        kvt = config.kv_transfer_config
        # Read once, here: the connector's spec (its settings are checked before the model
        # loads; the connectors get only the spec), the TP/DCP layout, the logical block size,
        # what sizing the KV cache takes.
        spec = connector_spec(kvt, config.scheduler_block_size) if kvt is not None else None
        layout = config.parallel_config.layout()
        block_size = config.scheduler_block_size
        self.tokenizer = Tokenizer(config.model_config.path)
        self.executor: Executor
        cache, model = config.cache_config, config.model_config
        sizing = KVCacheSizing(
            block_size=cache.block_size, dtype=model.dtype, max_model_len=model.max_model_len,
            cache_dtype=cache.cache_dtype, num_kv_blocks=cache.num_kv_blocks,
            kv_cache_memory_bytes=cache.kv_cache_memory_bytes, layout=layout)
        if layout.world_size > 1:  # one worker process per TP/DCP rank
            import torch

            if spec is not None and _has_pool(spec):  # refused here, before any rank starts
                from pdkv.kv_transfer.connector.pool import check_multi_rank_groups
                from pdkv.model.arch_config import LlamaArchConfig
                from pdkv.worker.kv_cache import group_kinds

                check_multi_rank_groups(
                    group_kinds(LlamaArchConfig.from_hf_folder(config.model_config.path)))

            self.executor = MultiprocExecutor(config, sizing, num_threads=torch.get_num_threads())
        else:
            self.executor = InProcExecutor(config, sizing, spec)
        self.connector = None
        if spec is not None:
            self.connector = create_connector(
                spec, KVConnectorRole.SCHEDULER, self.executor.kv_cache_config,
                self.executor.kv_layout, self.executor.connector_startup,
            )
        self.scheduler = Scheduler(
            config.scheduler_config,
            dataclasses.replace(config.cache_config, block_size=block_size),
            self.executor.kv_cache_config,
            connector=self.connector,
            kv_load_failure_policy=spec.load_failure_policy if spec is not None else "fail",
            enable_kv_cache_events=config.kv_events_config is not None
            and config.kv_events_config.active,
        )
        # KV cache events (--kv-events-config): bound last, so a failed start-up above leaves no
        # socket behind. The engine id in the topic is the KV connector's when there is one.
        self.kv_event_publisher: KVEventPublisher | None = None
        if config.kv_events_config is not None:
            import uuid

            engine_id = kvt.engine_id if kvt is not None else uuid.uuid4().hex
            self.kv_event_publisher = create_publisher(config.kv_events_config, engine_id)
        # The KV pool tiers' events (stored / dropped chunks) join the same per-step batches.
        # Their tiers live where the worker half runs: in this process only without worker
        # processes (TP/DCP engines' pool stores are in the workers; not reported yet).
        self.pool_events: PoolEventQueue | None = None
        if self.kv_event_publisher is not None and self.connector is not None:
            if self.executor.model_runner is not None:
                self.pool_events = PoolEventQueue()
                self.connector.report_tier_events(self.pool_events)
            elif spec is not None and _has_pool(spec):
                logger.info("KV events: an engine with worker processes does not report its "
                            "KV pool tiers' events (its pool stores live in the workers)")
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = self.executor.vocab_size
        self.eos_token_id = self.executor.eos_token_id
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_num_scheduled_tokens = 0

    @property
    def runner(self) -> ModelRunner | Executor:
        """The model runner in this process, else the executor (a name kept for the server's
        /kv_layout and fault injection, benchmarks and tests; the engine itself uses
        `executor`)."""
        return self.executor.model_runner or self.executor

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        args.apply_threads()
        return cls(args.create_engine_config())

    # ------------------------------------------------------------------ input
    def make_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: JSONObject | None = None,
    ) -> tuple[Request, str | None]:
        """Validate and tokenize one prompt without queuing it.

        Args:
            prompt: text, {"prompt_token_ids": [...]} / {"prompt": "..."}, or a token id list.

        Returns:
            (request, prompt text or None).

        Raises:
            ValueError: empty prompt, prompt too long for max_model_len, token ids outside the
                vocabulary, or bad sampling params: out of range for this model too
                (stop_token_ids outside the vocabulary, logprobs > MAX_LOGPROBS); the message
                names the problem.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(
                f"stop_token_ids: {bad_stop[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be at most {MAX_LOGPROBS}, got {params.prompt_logprobs}"
            )
        bad_bias = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad_bias:
            raise ValueError(
                f"token_id(s) {bad_bias} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {self.vocab_size}"
            )
        if params.structured_outputs is not None:
            compile_grammar(params.structured_outputs)  # ValueError naming what is wrong
        if params.n != 1:
            raise ValueError("n must be 1 for one engine request: LLM.generate and the server "
                             "run n > 1 as n requests (SamplingParams.child)")
        text: str | None = None
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
            text = prompt.get("prompt")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise ValueError("prompt must be a string")
            token_ids = self.tokenizer.encode(text) if text else []
        elif isinstance(prompt, list):
            token_ids = list(prompt)
        else:
            raise ValueError(f"unsupported prompt type {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in token_ids):
            raise ValueError("prompt_token_ids must be integers")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        max_len = self.config.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, longer than allowed: it must be shorter "
                f"than max_model_len={max_len} to leave room for an output token"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(
            rid,
            token_ids,
            params,
            block_size=self.config.scheduler_block_size,
            eos_token_id=self.eos_token_id,
            cache_salt=cache_salt,
            kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params else None,
        )
        if request.kv_transfer_params and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with kv_transfer_params (P/D): the "
                             "prompt's KV is computed on another engine")
        if request.kv_transfer_params:
            if self.connector is None:
                if request.kv_transfer_params.get("do_remote_prefill"):
                    raise ValueError(
                        "kv_transfer_params.do_remote_prefill needs an engine with "
                        "--kv-transfer-config"
                    )
                request.kv_transfer_params = None  # nothing to hand over without a connector
            else:
                self.connector.validate_request(request)
        return request, text

    def add_request(self, request: Request, prompt_text: str | None = None) -> None:
        """Queue a request made by make_request.

        Raises:
            ValueError: its id is already in use.
        """
        self.scheduler.add_request(request)
        self.output_processor.add_request(request, prompt_text)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests at any stage; their blocks are freed now. Unknown ids are ignored."""
        outs = []
        for req in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            out = self.output_processor.abort(req)
            if out is not None:
                outs.append(out)
        return outs

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of requests that produced tokens or finished."""
        sched_out = self.scheduler.schedule()
        self.last_num_scheduled_tokens = sched_out.total_num_scheduled_tokens
        runner_out = self.executor.execute_model(sched_out)
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        self.num_steps += 1
        self._publish_kv_events()
        outputs = []
        for update in updates:
            out, hit_stop = self.output_processor.process(update)
            if hit_stop and not update.finished:
                self.scheduler.finish_requests(
                    [update.request.request_id], RequestStatus.FINISHED_STOPPED
                )
            outputs.append(out)
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Drop every hash of the engine's prefix cache, so the next identical prompt is
        computed again (or loaded by a KV connector). vLLM's semantics: refused (False,
        nothing changed) while any KV cache block is in use; see Scheduler.reset_prefix_cache.
        Call it from the thread that steps the engine."""
        done = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def _publish_kv_events(self) -> None:
        """One batch of the KV cache events recorded since the last one (none: nothing sent)."""
        if self.kv_event_publisher is None:
            return
        events = self.scheduler.take_kv_events()
        if self.pool_events is not None:
            events += self.pool_events.take()
            dropped = self.pool_events.take_dropped()
            if dropped:
                self.kv_event_publisher.count_dropped_events(dropped)
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Requests unfinished or KV transfers/leases unresolved (anything still open)."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_kv_work()

    def needs_step(self) -> bool:
        """A step now would do something without waiting for an event: requests to schedule,
        outputs to report, or connector metadata to hand to the worker. Requests waiting for
        remote KV and held blocks do not count: their progress arrives as a connector wakeup
        (see `set_wakeup`) or at `next_deadline()`."""
        return self.scheduler.needs_step()

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """Give both connector halves the callback that wakes the engine loop (any thread): the
        scheduler half here, the worker halves through the executor (in worker processes: over
        its wakeup channel)."""
        if self.connector is not None:
            self.connector.set_wakeup(wakeup)
        self.executor.set_wakeup(wakeup)
        if self.pool_events is not None:  # a pool tier's event: an idle loop steps to publish
            self.pool_events.set_wakeup(wakeup)

    def next_deadline(self) -> float | None:
        """Earliest time.monotonic() at which a connector half needs a step (lease expiry or
        renewal, a pull's deadline), or None."""
        times = [self.connector.next_deadline() if self.connector is not None else None,
                 self.executor.next_deadline()]
        return min((t for t in times if t is not None), default=None)

    def kv_cache_summary(self) -> str:
        """One line for the start-up log: logical blocks x tokens and MiB per rank (with DCP each
        rank stores 1/dcp of every request's KV)."""
        par, kv = self.config.parallel_config, self.executor.kv_cache_config
        dcp = par.decode_context_parallel_size
        share = (f"each rank stores 1/{dcp} of every request's KV" if dcp > 1
                 else "each rank stores its KV heads of every request")
        split = (f"; tp {par.tensor_parallel_size}, dcp {dcp}: {share}"
                 if par.world_size > 1 else "")
        return (f"{kv.num_blocks} blocks x {self.config.scheduler_block_size} tokens "
                f"({kv.total_bytes / dcp / 2**20:.1f} MiB per rank{split})")

    def workers_alive(self) -> bool:
        """False once a worker process of a TP/DCP engine has exited, or a rank on another host
        was lost (always True in-process)."""
        return not self.executor.dead_workers()

    def check_workers(self) -> None:
        """Raises RuntimeError naming the ranks when a worker is gone (an idle engine's check:
        a step would fail on it anyway)."""
        dead = self.executor.dead_workers()
        if dead:
            raise RuntimeError(f"worker ranks {dead} are gone (process exited, or the link to "
                               "their host is down)")

    def shutdown(self) -> None:
        """Stop the executor (its worker processes, if any), the KV connector's worker half and
        the KV event publisher (what it has queued is sent first, within its deadline)."""
        self.executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()


def _has_pool(spec: ConnectorSpec) -> bool:
    """The connector is a KV pool, or a MultiConnector with one among its children."""
    if isinstance(spec, MultiSpec):
        return any(_has_pool(c) for c in spec.children)
    return isinstance(spec, PoolSpec)
