"""Model runner: turns a SchedulerOutput into tensors (positions, slot mapping, block tables),
runs the model over the paged KV cache and samples.

The runner keeps its own copy of each scheduled request's tokens and block table (vLLM's
"cached request state"), updated from the scheduler's deltas, so that the same messages can later
drive a worker in another process.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import CompressedKVSpec, KVCacheConfig, LinearStateSpec
from pdkv.config import CacheConfig, ModelConfig
from pdkv.kv_transfer.connector.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole
from pdkv.kv_transfer.connector.factory import create_connector
from pdkv.kv_transfer.connector.p2p_compat import MLA_KV_LAYOUT
from pdkv.kv_transfer.connector.spec import ConnectorSpec
from pdkv.kv_transfer.connector.startup import ConnectorStartup
from pdkv.model.arch_config import LlamaArchConfig
from pdkv.model.decode_layer import set_decode_layer_op
from pdkv.model.deepseek_v4 import DeepseekV4ForCausalLM
from pdkv.model.fused_ops import set_fused_ops
from pdkv.model.llama import LlamaForCausalLM
from pdkv.model.loader import TORCH_DTYPES, load_model, model_digest
from pdkv.model.paged_prefill import install_attention_backend
from pdkv.model.sampler import LogprobEntry, SamplingRow, sample_tensors
from pdkv.model.structured import GrammarMatchers
from pdkv.sampling_params import SamplingParams
from pdkv.sched.output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pdkv.tokenizer import Tokenizer
from pdkv.worker.attn_metadata import (
    StepRequest,
    build_attention_metadata,
    build_dcp_attention_metadata,
    build_linear_state_metadata,
    build_pcp_step,
    build_v4_step_metadata,
)
from pdkv.worker.cuda_graphs import build_decode_graphs, decode_step_inputs
from pdkv.worker.kv_cache import allocate_kv_cache, gdn_state_geometry

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from pdkv.parallel.context import ParallelContext

KVCacheSizer = Callable[[LlamaArchConfig, "int | None"], KVCacheConfig]
"""(the model's architecture, KV budget in bytes or None) -> the KV cache one rank allocates."""


@dataclass
class CachedRequestState:
    """The worker's view of one request."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    stop_ids: tuple[int, ...] = field(default_factory=tuple)
    # prompt_logprobs requests: entry of each prompt position computed so far ([0] is None).
    prompt_logprobs: list[list[LogprobEntry] | None] | None = None
    matcher: LLMatcher | None = None  # structured output: the request's grammar matcher


@dataclass
class StepTimings:
    """Seconds spent in the last execute_model call."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    dcp_comm: float = 0.0  # DCP all-gathers + LSE merge inside forward (0 without DCP)
    pcp_comm: float = 0.0  # PCP all-gathers inside forward (0 in a step PCP did not split)


class ModelRunner:
    """Owns the model weights and the KV cache of one worker.

    Args:
        model_config: model path, dtype, device, max_model_len, seed.
        cache_config: block size and KV cache budget.
        connector: the KV connector's spec (`connector_spec`), when set its worker half is
            built here.
        parallel: this rank's TP/DCP context (None: one process holds the whole model). With DCP
            the block tables are logical (block_size × dcp tokens per block id) and this rank
            stores the K/V of the tokens it owns (pdkv.parallel.layout). With PCP every rank
            holds a full KV replica and computes its part of a split step (pdkv.parallel.pcp);
            only PCP rank 0 builds the connector's worker half.
        kv_cache_config: asked once, after the weights are loaded, for the KV cache this rank
            allocates: called with the model's architecture and the KV budget in bytes measured
            now (with gpu_memory_utilization and no num_kv_blocks; else None). The executor sizes
            it (pdkv.worker.kv_cache.make_kv_cache_config); the runner never does.
        node_host: a TP/DCP rank's host address as the engine reaches it (its KV pool lookup
            server listens there); "": 127.0.0.1 (one host).

    Raises:
        ValueError: max_model_len exceeds the model's positions, or (from kv_cache_config) the
            KV cache is too small.
    """

    KV_LAYOUT = "blocks_layers_kv_tokens_heads_dim"

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        connector: ConnectorSpec | None,
        parallel: ParallelContext | None,
        kv_cache_config: KVCacheSizer,
        node_host: str = "",
    ) -> None:
        self.model_config = model_config
        self.parallel = parallel
        self.device = torch.device(model_config.device)
        self.dtype = TORCH_DTYPES[model_config.dtype]
        self.model: LlamaForCausalLM = load_model(
            model_config.path, model_config.dtype, model_config.device, parallel
        )
        from pdkv.model.cpu_linear import setup_cpu_linear

        self.cpu_linear = setup_cpu_linear(
            self.model, model_config.cpu_linear, model_config.dtype, model_config.device
        )
        arch = self.model.cfg
        self.attention_backend = install_attention_backend(
            self.model,
            model_config.attention_backend,
            model_config.device,
            cache_config.cache_dtype,
            parallel.dcp_size if parallel is not None else 1,
            arch.is_mla,
            "DeepSeek-V4" if arch.v4 is not None else None,
        )
        self.fused_ops = set_fused_ops(self.model, model_config.fused_ops)
        # Decode steps' layers as one C++ op each where the choices above allow it.
        self.decode_layer_ops = set_decode_layer_op(self.model, self.fused_ops,
                                                    self.attention_backend)
        if model_config.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={model_config.max_model_len} exceeds the model's "
                f"max_position_embeddings={arch.max_position_embeddings}"
            )
        self.eos_token_id = arch.eos_token_id
        self.block_size = cache_config.block_size
        budget: int | None = None
        if cache_config.num_kv_blocks is None and cache_config.gpu_memory_utilization is not None:
            from pdkv.worker.memory import free_memory_bytes, kv_budget_bytes

            budget = kv_budget_bytes(
                free_memory_bytes(self.device), cache_config.gpu_memory_utilization
            )
        self.kv_cache_config: KVCacheConfig = kv_cache_config(arch, budget)
        # Quantized KV (issue 12): identity for P/D (a different value refuses the pair) and
        # part of the pool namespace ("kv_quant"; None = not quantized).
        kv_dtype: str = getattr(self.kv_cache_config.groups[0].spec, "cache_dtype", "auto")
        # A PCP engine's ranks hold full replicas: to a peer its KV is that of one rank at tp 1
        # (nothing stated), as vLLM's PCP producers publish (one rank, PR #52779).
        lay = (parallel.layout if parallel is not None and parallel.layout.kv_publishers > 1
               else None)
        self.kv_layout = KVLayout(
            model_digest=model_digest(model_config.path), dtype=model_config.dtype,
            block_size=cache_config.block_size, num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads, head_size=arch.head_dim,
            kv_layout=MLA_KV_LAYOUT if arch.is_mla else self.KV_LAYOUT, kv_cache_dtype=kv_dtype,
            # Gated DeltaNet: re-sharding its state slot
            linear_state=(gdn_state_geometry(arch, model_config.dtype)
                          if arch.has_linear_state and not arch.is_mla else None),
            kv_quant=f"{kv_dtype}:per_token_head_absmax" if kv_dtype != "auto" else None,
            tp_size=lay.tp_size if lay else None, dcp_size=lay.dcp_size if lay else None,
            interleave=lay.interleave if lay else None,
            dcp_replicated=lay.dcp_replicated if lay else None,
            num_local_kv_heads=self.model.num_local_kv_heads if lay else None)
        # Start-up values both connector halves of this engine share (see the factory).
        self.connector_startup = ConnectorStartup()
        if parallel is not None:
            self.connector_startup = ConnectorStartup(
                dcp_rank=parallel.dcp_rank, dcp_size=parallel.dcp_size, rank=parallel.rank,
                world_size=parallel.layout.kv_publishers, tp_rank=parallel.tp_rank,
                tp_size=parallel.tp_size, node_host=node_host or "127.0.0.1")
        self.connector: KVConnectorBase | None = None
        # With PCP only PCP rank 0 builds a worker half: the other ranks' replicas are equal
        # to its own, so they serve, register and report nothing (ParallelLayout.publishes_kv).
        if connector is not None and (parallel is None
                                      or parallel.layout.publishes_kv(parallel.rank)):
            self.connector = create_connector(
                connector, KVConnectorRole.WORKER, self.kv_cache_config, self.kv_layout,
                self.connector_startup,
            )
        self.kv_cache_groups, self.kv_caches = allocate_kv_cache(
            self.kv_cache_config, self.dtype, self.device,
            self.connector.kv_cache_buffer if self.connector is not None else None,
            prefault=cache_config.prefault,
        )
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_cache_groups)
        self.requests: dict[str, CachedRequestState] = {}
        self.timings = StepTimings()
        self._grammars: GrammarMatchers | None = None  # built by the first structured request
        # CUDA graphs of decode steps (on CUDA unless --enforce-eager; None: every step eager)
        self.decode_graphs = build_decode_graphs(
            () if model_config.enforce_eager else model_config.cudagraph_capture_sizes,
            model_config.max_model_len, self.model, self.kv_cache_config.groups, self.kv_caches,
            self.block_size, self.device, parallel.layout.world_size if parallel is not None else 1,
            self.connector is not None)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        return self.model.cfg.vocab_size

    # ------------------------------------------------------------------ state
    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            gen = None
            if not params.greedy:
                seed = params.seed
                if seed is None:
                    seed = (self.model_config.seed << 32) ^ zlib.crc32(new.req_id.encode())
                gen = torch.Generator(device=self.device).manual_seed(seed)
            stop_ids = tuple(params.stop_token_ids)
            if not params.ignore_eos and self.eos_token_id is not None:
                stop_ids += (self.eos_token_id,)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                block_ids=tuple(list(b) for b in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=gen,
                stop_ids=stop_ids,
                prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                matcher=self._matcher(params, new.token_ids[new.num_prompt_tokens:]),
            )
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for blocks, new_ids in zip(state.block_ids, cached.new_block_ids):
                blocks.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _matcher(self, params: SamplingParams, output_ids: list[int]) -> LLMatcher | None:
        if params.structured_outputs is None:
            return None
        if self._grammars is None:
            self._grammars = GrammarMatchers(
                Tokenizer(self.model_config.path).hf, self.model.cfg.vocab_size, self.eos_token_id)
        matcher: LLMatcher = self._grammars.matcher(params.structured_outputs, list(output_ids))
        return matcher

    # -------------------------------------------------------------- execution
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the tokens sampled for requests that reached their end."""
        t0 = time.perf_counter()
        self._update_states(out)
        conn = self.connector
        if conn is not None:
            conn.bind_connector_metadata(out.kv_connector_metadata)
            conn.start_load_kv()
        if out.total_num_scheduled_tokens == 0:
            if conn is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return ModelRunnerOutput(
                sampled_token_ids={}, kv_connector_output=self._connector_output(out)
            )
        graphs = self.decode_graphs
        # A step with a connector runs eagerly, so its per-layer hooks run (`graphable` already
        # refuses graphs when the engine starts with a connector; this keeps it so for one set
        # later).
        graph_in = (
            decode_step_inputs(out.num_scheduled_tokens, self.requests, graphs)
            if graphs and conn is None else None
        )
        meta: list[Any] | None = None
        if graphs is not None and graph_in is not None:  # a decode step: replay its CUDA graph
            ids, pos, tables, sampled_reqs = graph_in
            prompt_rows: list[tuple[CachedRequestState, int, int]] = []
            t1 = time.perf_counter()
            logits = graphs.run(ids, pos, tables)
        else:
            input_ids, positions, meta, logits_idx, sampled_reqs, prompt_rows = (
                self._prepare_inputs(out)
            )
            t1 = time.perf_counter()
            if conn is None:  # a plain step: the forward's hook default (None)
                logits = self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
            else:  # per-layer wait_for_layer_load / save_kv_layer (pdkv/model/layer_hooks.py)
                logits = self.model(input_ids, positions, self.kv_caches, meta, logits_idx,
                                    layer_hooks=conn)
        t2 = time.perf_counter()
        if prompt_rows:
            self._prompt_logprobs(logits[len(sampled_reqs):], prompt_rows)
            logits = logits[: len(sampled_reqs)]
        rows = []
        for state in sampled_reqs:
            num_out = len(state.token_ids) - state.num_prompt_tokens
            mask = state.stop_ids if num_out < state.sampling_params.min_tokens else ()
            rows.append(SamplingRow(state.sampling_params, state.generator, mask, state.token_ids,
                                    state.num_prompt_tokens, state.matcher))
        # Ids (and logprob rows) stay on the device until here: one device -> host copy per step.
        tokens, logprobs = sample_tensors(logits, rows).to_host() if rows else ([], None)
        result: dict[str, list[int]] = {}
        lp_out: dict[str, list[list[LogprobEntry]]] | None = (
            {} if logprobs is not None else None
        )
        prompt_lp: dict[str, list[list[LogprobEntry] | None]] = {}
        for i, state in enumerate(sampled_reqs):
            state.token_ids.append(tokens[i])
            if state.matcher is not None:
                state.matcher.consume_token(tokens[i])
            result[state.req_id] = [tokens[i]]
            if lp_out is not None and logprobs is not None and logprobs[i]:
                lp_out[state.req_id] = [logprobs[i]]
            if state.prompt_logprobs is not None:
                prompt_lp[state.req_id] = state.prompt_logprobs
                state.prompt_logprobs = None  # sent once, with the first sampled token
        for req_id, n in out.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        t3 = time.perf_counter()
        self.timings = StepTimings(
            prepare=t1 - t0,
            forward=t2 - t1,
            sample=t3 - t2,
            dcp_comm=meta[0].dcp.comm_seconds if meta and meta[0].dcp is not None else 0.0,
            pcp_comm=meta[0].pcp.comm_seconds
            if meta and getattr(meta[0], "pcp", None) is not None else 0.0,
        )
        kv_out = self._connector_output(out) if conn is not None else None
        return ModelRunnerOutput(
            sampled_token_ids=result,
            logprobs=lp_out or None,
            kv_connector_output=kv_out,
            prompt_logprobs=prompt_lp or None,
        )

    def _prompt_logprobs(self, logits: torch.Tensor,
                         rows: list[tuple[CachedRequestState, int, int]]) -> None:
        """Append prompt logprob entries: for each (state, first position, count), the logits
        rows of positions p .. p+count-1 give the logprob of prompt token p+1 (batched)."""
        lps = torch.log_softmax(logits, dim=-1)
        at = 0
        for state, first, count in rows:
            part = lps[at : at + count]
            at += count
            targets = torch.tensor(
                state.token_ids[first + 1 : first + 1 + count], device=lps.device
            )
            target_lp = part.gather(1, targets[:, None])
            ranks = ((part > target_lp).sum(-1) + 1).tolist()
            k = state.sampling_params.prompt_logprobs or 0
            top = torch.topk(part, k, dim=-1) if k else None
            top_ids = top.indices.tolist() if top is not None else [[]] * count
            top_lps = top.values.tolist() if top is not None else [[]] * count
            assert state.prompt_logprobs is not None
            for j, (t, lp, rank) in enumerate(
                zip(targets.tolist(), target_lp[:, 0].tolist(), ranks)
            ):
                state.prompt_logprobs.append(
                    [(t, lp, rank)]
                    + [(i, v, r + 1) for r, (i, v) in enumerate(zip(top_ids[j], top_lps[j]))]
                )

    def _connector_output(self, out: SchedulerOutput) -> KVConnectorOutput:
        conn = self.connector
        assert conn is not None
        conn.wait_for_save()
        sending, recving = conn.get_finished(out.finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        errors = conn.get_load_errors()
        policies = conn.get_load_failure_policies()
        stats, times = conn.get_stats()
        conn.clear_connector_metadata()
        return KVConnectorOutput(
            finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid,
            load_errors=errors, stats=stats, transfer_seconds=times,
            observations=conn.get_observations(), load_failure_policies=policies,
            request_bytes=conn.get_request_bytes(),
        )

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()

    def _prepare_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, list[Any], torch.Tensor, list[CachedRequestState],
               list[tuple[CachedRequestState, int, int]]]:
        ids: list[int] = []
        pos: list[int] = []
        logits_idx: list[int] = []
        sampled: list[CachedRequestState] = []
        prompt_idx: list[int] = []
        prompt_rows: list[tuple[CachedRequestState, int, int]] = []
        step_reqs: list[StepRequest] = []  # tables of group 0; other groups: below
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start = len(ids)
            c = state.num_computed_tokens
            ids.extend(state.token_ids[c : c + n])
            pos.extend(range(c, c + n))
            step_reqs.append((start, n, c, state.block_ids[0]))
            if c + n == len(state.token_ids):
                logits_idx.append(start + n - 1)
                sampled.append(state)
            if state.prompt_logprobs is not None:
                # Positions c .. c+n-1 predict prompt tokens c+1 ..; the last prompt token
                # predicts the first output token (sampled above), not a prompt token.
                count = min(c + n, state.num_prompt_tokens - 1) - c
                if count > 0 and len(state.prompt_logprobs) == c + 1:
                    prompt_idx.extend(range(start, start + count))
                    prompt_rows.append((state, c, count))

        dev = self.device
        par = self.parallel
        meta: list[Any]  # AttentionMetadata per attention group, LinearStateMetadata per linear one
        if par is not None and par.pcp_size > 1:  # dense only (checked at start-up)
            split = build_pcp_step(par, step_reqs, logits_idx + prompt_idx, self.block_size, dev)
            if split is not None:  # this rank computes only its tokens (pdkv.parallel.pcp)
                local_idx, local_meta = split
                return (
                    torch.tensor(ids, dtype=torch.long, device=dev)[local_idx],
                    torch.tensor(pos, dtype=torch.long, device=dev)[local_idx],
                    [local_meta],
                    torch.tensor(logits_idx + prompt_idx, dtype=torch.long, device=dev),
                    sampled,
                    prompt_rows,
                )
        if par is not None and par.dcp_size > 1:  # dense only (DCP + sliding window is refused)
            meta = [build_dcp_attention_metadata(par, step_reqs, self.block_size, dev)]
        else:  # one metadata per KV cache group: its own block tables and window
            meta = []
            for g, group in enumerate(self.kv_cache_config.groups):
                if isinstance(group.spec, CompressedKVSpec):  # DeepSeek-V4: its tables, below
                    meta.append(None)
                    continue
                if isinstance(group.spec, LinearStateSpec):  # state slots: source and segments
                    meta.append(build_linear_state_metadata(
                        [(start, n, c, self.requests[req_id].block_ids[g])
                         for (start, n, c, _), req_id in zip(step_reqs, out.num_scheduled_tokens)],
                        self.block_size, dev))
                    continue
                reqs = step_reqs if g == 0 else [
                    (start, n, c, self.requests[req_id].block_ids[g])
                    for (start, n, c, _), req_id in zip(step_reqs, out.num_scheduled_tokens)]
                window = getattr(group.spec, "sliding_window", None)
                meta.append(build_attention_metadata(reqs, len(ids), self.block_size, dev, window))
            if isinstance(self.model, DeepseekV4ForCausalLM):
                meta.append(build_v4_step_metadata(
                    step_reqs, [self.requests[r].block_ids for r in out.num_scheduled_tokens],
                    self.kv_cache_config.groups, meta, dev))
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logits_idx + prompt_idx, dtype=torch.long, device=dev),
            sampled,
            prompt_rows,
        )
