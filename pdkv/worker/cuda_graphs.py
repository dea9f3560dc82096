"""CUDA graphs for decode steps (vLLM's piecewise-free "full" decode graphs, simplified).

A decode step (every scheduled request runs one query token) launches hundreds of small kernels;
on a GPU the launch overhead dominates at small batch. With graphs (the default on CUDA; vLLM's
`--enforce-eager` turns them off, and the CPU is always eager) the model forward of a decode step
of B requests is captured once per capture size and replayed:

- capture sizes (`capture_sizes`): vLLM's default list, 1, 2, 4, then every multiple of 8 up to
  256, then every multiple of 16, up to `max_capture_size` (= min(max_num_seqs, 512));
- a step of B requests runs the graph of the smallest captured size >= B (`padded_size`); larger
  steps, and steps that are not pure decodes, run eagerly;
- static input buffers (`DecodeGraphs`) hold input ids, positions, block tables (one per KV cache
  group, padded to max_model_len / block_size blocks) and seq lens; everything else the attention
  needs (slots, the key mask, the key slots of each row) is derived from them inside the graph
  (`decode_metadata`), with no host read, so a replay sees the step's values;
- padded rows repeat the last real row (same token, position and table): they compute the same K/V
  and write the same value into the same slot, so no real slot is disturbed (torch has no
  "skip slot -1" write such as vLLM's PAD_SLOT_ID kernel); their logits are dropped.

Only plain full-attention (and MLA) KV caches are graphed: sliding-window groups, linear-state
groups, quantized KV, TP / DCP (collectives) and KV connectors stay eager (`graphable`). The key
range is the whole max_model_len for every row (masked), so graphs trade attention work for launch
overhead; the benefit is measured by `scripts/gpu_check.sh`, not assumed.

The pure-Python parts (sizes, padding) import no torch at module level; `DecodeGraphs` runs the
same static-buffer forward eagerly on the CPU (`use_graphs=False`), which tests compare with the
ordinary path (tests/worker/test_cuda_graphs.py).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import torch
    from torch.cuda import _POOL_HANDLE

    from pdkv.cache.specs import KVCacheGroupSpec
    from pdkv.model.attention import AttentionMetadata
    from pdkv.model.kv_quant import KVCacheLayer

T = TypeVar("T")

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
"""vLLM's default largest decode batch captured."""


def capture_sizes(max_num_seqs: int, max_capture_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Decode batch sizes to capture, ascending: 1, 2, 4, then multiples of 8 below 256, then
    multiples of 16 (vLLM's default cudagraph_capture_sizes), none above
    min(max_num_seqs, max_capture_size), which is itself included.

    Raises:
        ValueError: max_num_seqs < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, max_capture_size)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, top + 1, 16))
    return sorted({s for s in sizes if s <= top} | {top})


def padded_size(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= batch (sizes ascending), None when batch exceeds them all
    (run eagerly)."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def pad_rows(rows: Sequence[T], size: int) -> list[T]:
    """`rows` followed by copies of its last element up to `size` entries (padded rows repeat the
    last real row; see the module docstring). Raises ValueError when rows is empty or longer."""
    if not rows or len(rows) > size:
        raise ValueError(f"cannot pad {len(rows)} rows to {size}")
    return list(rows) + [rows[-1]] * (size - len(rows))


def graphable(groups: Sequence[KVCacheGroupSpec], kv_caches: Sequence[KVCacheLayer],
              world_size: int, has_connector: bool) -> str | None:
    """None when decode steps can run as graphs, else why not (one phrase). groups: the KV cache
    config's groups (their `spec`); kv_caches: the per-layer caches; world_size: TP x DCP ranks
    (collectives are not captured: more than one rank stays eager)."""
    import torch

    from pdkv.cache.specs import LinearStateSpec

    if world_size > 1:
        return "tensor / decode context parallelism"
    if has_connector:
        return "a KV connector"
    for g in groups:
        if isinstance(g.spec, LinearStateSpec):
            return "linear-state layers"
        if getattr(g.spec, "sliding_window", None) is not None:
            return "sliding-window layers"
    if any(not isinstance(c, torch.Tensor) for c in kv_caches):
        return "a quantized KV cache"
    return None


def build_decode_graphs(sizes: Sequence[int], max_model_len: int,
                        model: Callable[..., torch.Tensor], groups: Sequence[KVCacheGroupSpec],
                        kv_caches: list[KVCacheLayer], block_size: int, device: torch.device,
                        world_size: int, has_connector: bool) -> DecodeGraphs | None:
    """The model runner's DecodeGraphs: on a CUDA device with capture sizes (decode batch sizes,
    ascending; () under enforce_eager), when `graphable` allows (else one info log line saying
    why); None: every step runs eagerly. max_model_len: longest sequence in tokens."""
    if device.type != "cuda" or not sizes:
        return None
    why = graphable(groups, kv_caches, world_size, has_connector)
    if why is not None:
        logger.info("CUDA graphs off (%s): decode steps run eagerly", why)
        return None
    return DecodeGraphs(model, kv_caches, len(groups), block_size, max_model_len, sizes, device,
                        use_graphs=True)


def decode_metadata(tables: torch.Tensor, positions: torch.Tensor,
                    block_size: int) -> AttentionMetadata:
    """AttentionMetadata of a decode step from device tensors only (no host read, so it can be
    captured): tables [B, W] long (padded), positions [B] long (the new token's position; the
    row's keys are 0 .. position). Masked keys read the row's newest key (always written)."""
    import torch

    from pdkv.model.attention import AttentionMetadata

    bsz, width = tables.shape
    seq_lens = positions + 1
    slot_blocks = tables.gather(1, (positions // block_size)[:, None])[:, 0]
    keys = torch.arange(width * block_size, device=tables.device)[None, :]
    visible = keys < seq_lens[:, None]
    rel = torch.where(visible, keys, positions[:, None])
    return AttentionMetadata(
        slot_block_ids=slot_blocks, slot_offsets=positions % block_size, prefills=[],
        decode_token_idx=torch.arange(bsz, device=tables.device), decode_block_tables=tables,
        decode_seq_lens=seq_lens, decode_mask=visible[:, None, None, :],
        decode_key_blocks=tables.gather(1, rel // block_size), decode_key_offsets=rel % block_size,
        all_decode=True,
    )


class DecodeGraphs:
    """Static buffers and captured graphs of decode steps for one model runner.

    Args:
        forward: the model forward (input_ids, positions, kv_caches, metas, logits_indices) ->
            [S, vocab] logits.
        kv_caches: the per-layer KV caches the forward reads and writes.
        num_groups: KV cache groups (one table per group per row).
        block_size: tokens per block.
        max_model_len: longest sequence in tokens (tables hold ceil(max_model_len / block_size)).
        sizes: capture sizes, ascending (`capture_sizes`).
        device: where the buffers live.
        use_graphs: capture and replay CUDA graphs (True on CUDA); False runs the same padded
            static-buffer forward eagerly (the CPU test of the path).
    """

    def __init__(self, forward: Callable[..., torch.Tensor], kv_caches: list[KVCacheLayer],
                 num_groups: int, block_size: int, max_model_len: int, sizes: Sequence[int],
                 device: torch.device, use_graphs: bool) -> None:
        import torch

        self.forward, self.kv_caches = forward, kv_caches
        self.block_size, self.sizes, self.use_graphs = block_size, list(sizes), use_graphs
        self.width = -(-max_model_len // block_size)
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.tables = torch.zeros(num_groups, top, self.width, dtype=torch.long, device=device)
        # size -> (CUDAGraph, output logits)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: _POOL_HANDLE | None = None  # one memory pool shared by every captured graph

    def fits(self, batch: int) -> bool:
        """True when a decode step of `batch` requests has a captured size."""
        return padded_size(batch, self.sizes) is not None

    def run(
        self, input_ids: list[int], positions: list[int], tables: Sequence[Sequence[list[int]]]
    ) -> torch.Tensor:
        """Logits [B, vocab] of a decode step of B requests (B <= the largest size).

        Args:
            input_ids, positions: per request its one new token and that token's position.
            tables: per KV cache group, per request its block table (covering the position).
        """
        import torch

        bsz = len(input_ids)
        size = padded_size(bsz, self.sizes)
        assert size is not None, f"decode batch {bsz} above the largest capture size"
        self.input_ids[:size].copy_(
            torch.tensor(pad_rows(input_ids, size), device="cpu"), non_blocking=True
        )
        self.positions[:size].copy_(
            torch.tensor(pad_rows(positions, size), device="cpu"), non_blocking=True
        )
        host = [
            [t[: self.width] + [0] * (self.width - len(t)) for t in pad_rows(group, size)]
            for group in tables
        ]
        self.tables[:, :size].copy_(
            torch.tensor(host, dtype=torch.long, device="cpu"), non_blocking=True
        )
        if not self.use_graphs:
            return self._step(size)[:bsz]
        if size not in self.graphs:
            self._capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:bsz]

    def _step(self, size: int) -> torch.Tensor:
        """The graphed region: metadata from the static buffers, then the forward."""
        import torch

        metas = [decode_metadata(self.tables[g, :size], self.positions[:size], self.block_size)
                 for g in range(self.tables.shape[0])]
        idx = torch.arange(size, device=self.input_ids.device)
        return self.forward(
            self.input_ids[:size], self.positions[:size], self.kv_caches, metas, idx
        )

    def _capture(self, size: int) -> None:
        """Warm up on a side stream (as torch's docs require), then capture the step of `size`
        rows into a graph sharing the others' memory pool."""
        import torch

        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(size)
        self.graphs[size] = (graph, out)


class DecodeRequest(Protocol):
    """What decode_step_inputs reads of a request's state (the runner's CachedRequestState)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_ids(self) -> tuple[list[int], ...]: ...

    @property
    def prompt_logprobs(self) -> object: ...


R = TypeVar("R", bound=DecodeRequest)


def decode_step_inputs(scheduled: dict[str, int], requests: dict[str, R], graphs: DecodeGraphs
                       ) -> tuple[list[int], list[int], list[list[list[int]]], list[R]] | None:
    """Inputs of a step the graphs can run, else None (run it eagerly).

    Args:
        scheduled: the step's {request id: scheduled tokens} (flat-batch order).
        requests: the runner's CachedRequestState by id (token_ids, num_computed_tokens,
            block_ids per group, prompt_logprobs).

    Returns:
        (input ids, positions, per group the requests' block tables, the sampled request states
        in order) when every request runs exactly its last token (a decode) with no prompt
        logprobs and the batch fits a captured size.
    """
    if not graphs.fits(len(scheduled)):
        return None
    ids, pos, states = [], [], []
    for req_id, n in scheduled.items():
        state = requests[req_id]
        c = state.num_computed_tokens
        if n != 1 or c + 1 != len(state.token_ids) or state.prompt_logprobs is not None:
            return None
        ids.append(state.token_ids[c])
        pos.append(c)
        states.append(state)
    tables = [[list(s.block_ids[g]) for s in states] for g in range(len(states[0].block_ids))]
    return ids, pos, tables, states
