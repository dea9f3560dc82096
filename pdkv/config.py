"""Frozen configuration, one dataclass per area (vLLM's names where they exist).

Each component receives only its own config. Derived values are properties; nothing is mutated
after start-up. `pdkv.engine.arg_utils.EngineArgs` is the one place where CLI flags and keyword
arguments become these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdkv.cache.specs import KV_CACHE_DTYPES
from pdkv.kv_events.config import KVEventsConfig
from pdkv.parallel.layout import ParallelLayout

_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """What model to run and how.

    Attributes:
        model: the name the user gave (an alias such as "smollm2" or a folder path).
        path: resolved local HF-format folder (config.json + *.safetensors + tokenizer files).
        dtype: "float32" | "float16" | "bfloat16" for weights and KV cache.
        device: "cpu" or "cuda[:N]".
        max_model_len: longest sequence (prompt + output) in tokens.
        seed: base seed for random sampling of requests that give none.
        served_model_name: the name reported to clients.
        cpu_linear: "panel" (the default: float32 / bfloat16 weights packed in 16-row panels
            for pdkv's AVX2 kernel, pdkv/model/panel_linear.py; elsewhere onednn), "onednn"
            (packed-weight oneDNN matmuls where oneDNN has a kernel for the dtype, else auto's
            table), "auto" (one plain weight copy; BLAS or oneDNN per row count from a table
            timed at start-up, pdkv/model/cpu_linear.py) or "torch" (BLAS).
        attention_backend: vLLM's `--attention-backend`: "auto", "torch" (gather + SDPA) or
            "cpu_paged" (decode reads K/V from the blocks in place; pdkv/model/paged_decode.py).
        enforce_eager: vLLM's `--enforce-eager`: no CUDA graphs (the CPU is always eager).
        cudagraph_capture_sizes: decode batch sizes captured as CUDA graphs on a CUDA device
            (pdkv.worker.cuda_graphs.capture_sizes of max_num_seqs); () = none.
        fused_ops: run the C++ fused small ops (RMSNorm, residual add, RoPE, SiLU·mul) on CPU
            float32 when pdkv's extension is built (pdkv/model/fused_ops.py); False: torch ops.
    """

    model: str
    path: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int = 8192
    seed: int = 0
    served_model_name: str = ""
    cpu_linear: str = "panel"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] = ()
    fused_ops: bool = True

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "torch", "cpu_paged"):
            raise ValueError(
                "attention_backend must be 'auto', 'torch' or 'cpu_paged', got "
                f"{self.attention_backend!r}"
            )
        if self.cpu_linear not in ("panel", "onednn", "auto", "torch"):
            raise ValueError(
                f"cpu_linear must be 'panel', 'onednn', 'auto' or 'torch', got {self.cpu_linear!r}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape.

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the pool (per KV cache group); None = derived from
            kv_cache_memory_bytes by the worker.
        kv_cache_memory_bytes: memory budget for the KV cache when num_kv_blocks is None.
        enable_prefix_caching: reuse full blocks across requests by block hash.
        gpu_memory_utilization: when set and num_kv_blocks is None, the KV cache budget is this
            fraction of the memory free once the weights are loaded (GPU: free device memory;
            CPU: available RAM), replacing kv_cache_memory_bytes.
        cache_dtype: vLLM's `--kv-cache-dtype`: "auto" (the model dtype), "int8" or "fp8" /
            "fp8_e4m3" (1 byte per value plus a float32 scale per token and KV head for K and
            for V; pdkv/model/kv_quant.py).
        prefault: write the whole KV cache once at start (CPU), so its memory is resident from
            the start, as a GPU's is: the process's RSS is its steady state at once and a host
            without the memory fails at start, not under load. Off: pages enter the resident set
            when K/V is first written to them (the RSS grows with use up to the cache's size).

    Raises:
        ValueError: an option out of range, or an unknown cache_dtype.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float | None = None
    cache_dtype: str = "auto"
    prefault: bool = False

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.cache_dtype!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one engine step (prefill chunks + decodes).
        max_model_len: longest sequence in tokens (copied from ModelConfig).
        enable_chunked_prefill: split a prompt over several steps when it exceeds the budget.
        remote_kv_watermark: fraction of the KV blocks that must stay free after admitting an
            asynchronous (remote) KV load, on top of one block per running or loading request
            (their next decode block), so a burst of decode legs cannot cause preemptions.
        max_mixed_prefill_tokens: most prompt tokens (prefill chunks, all requests together) in
            a step that also runs decode tokens; 0 = no cap beyond max_num_batched_tokens. A
            step without decodes is not capped, so a lone prompt's TTFT is unchanged. It bounds
            how long running decodes wait behind a long prefill (the inter-token latency tail).
            vLLM's nearest knob, `long_prefill_token_threshold`, caps every chunk of every
            request, decodes running or not. Needs chunked prefill.
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    remote_kv_watermark: float = 0.01
    max_mixed_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_mixed_prefill_tokens < 0:
            raise ValueError(
                f"max_mixed_prefill_tokens must be >= 0, got {self.max_mixed_prefill_tokens}")
        if self.max_mixed_prefill_tokens and not self.enable_chunked_prefill:
            raise ValueError("max_mixed_prefill_tokens needs chunked prefill (a prompt that "
                             "cannot be split cannot be capped)")
        if not 0.0 <= self.remote_kv_watermark < 1.0:
            raise ValueError(
                f"remote_kv_watermark must be in [0, 1), got {self.remote_kv_watermark}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout of one engine: TP, DCP and PCP sizes (vLLM's flags and constraints).

    Attributes:
        tensor_parallel_size: TP ranks (weights and attention heads sharded).
        decode_context_parallel_size: DCP ranks sharing one request's KV (tokens sharded).
        cp_kv_cache_interleave_size: consecutive tokens placed on one DCP rank (I).
        dcp_replicate_weights: DCP ranks each hold a whole TP shard of the weights (world size
            tp × dcp) instead of DCP being carved out of TP (vLLM's mode, world size tp). None =
            replicated when tensor_parallel_size is 1 (vLLM's rule cannot apply there).
        prefill_context_parallel_size: PCP ranks (vLLM's flag): long prefill runs of a step are
            split over them (pdkv.parallel.pcp), each holding the whole model and a full KV
            replica; built at tp 1, dcp 1, one node.
        distributed_init_port: 127.0.0.1 port of torch.distributed's rendezvous (0 = a free one).
        worker_timeout_s: deadline of one worker reply (start-up: model load; then one step).
        nnodes, node_rank, master_addr, master_port: vLLM's multi-node flags. The world's ranks
            are split evenly over `nnodes` hosts, node n holding ranks n·(world / nnodes) on;
            node 0 (the leader) runs the engine, the others run `pdkv serve --headless`
            (pdkv.executor.nodes). torch.distributed meets at master_addr:master_port (the
            leader's address), the executor's TCP control channels at master_port + 1.

    Raises:
        ValueError: a size below 1, DCP not dividing TP in vLLM mode, an interleave that does not
            divide the block size (checked in EngineConfig); nnodes not dividing the world size,
            node_rank outside [0, nnodes), several nodes without master_addr / master_port.
    """

    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    dcp_replicate_weights: bool | None = None
    prefill_context_parallel_size: int = 1
    distributed_init_port: int = 0
    worker_timeout_s: float = 600.0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0

    def __post_init__(self) -> None:
        world = self.layout().world_size  # raises ValueError on bad sizes
        if self.worker_timeout_s <= 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.prefill_context_parallel_size > 1:
            raise ValueError(
                f"prefill_context_parallel_size={self.prefill_context_parallel_size} across "
                f"nodes (nnodes={self.nnodes}) is not built yet; run the PCP ranks on one node"
            )
        if self.nnodes > 1:
            if world % self.nnodes:
                raise ValueError(f"nnodes {self.nnodes} must divide the world size {world} "
                                 "(tp x dcp ranks, split evenly over the nodes)")
            if not self.master_addr:
                raise ValueError("several nodes (nnodes > 1) need --master-addr: the leader's "
                                 "address, which every node reaches")
            if not 1 <= self.master_port <= 65534:
                raise ValueError(f"several nodes need --master-port in 1-65534 (it and the "
                                 f"next port are the leader's), got {self.master_port}")

    @property
    def dcp_replicated(self) -> bool:
        """Replicated-weights DCP (see dcp_replicate_weights)."""
        if self.dcp_replicate_weights is None:
            return self.tensor_parallel_size == 1 and self.decode_context_parallel_size > 1
        return self.dcp_replicate_weights

    def layout(self) -> ParallelLayout:
        """The rank mapping (pdkv.parallel.layout)."""
        return ParallelLayout(
            tp_size=self.tensor_parallel_size,
            dcp_size=self.decode_context_parallel_size,
            interleave=self.cp_kv_cache_interleave_size,
            dcp_replicated=self.dcp_replicated,
            pcp_size=self.prefill_context_parallel_size,
        )

    @property
    def world_size(self) -> int:
        """Worker processes (1 = the model runs in the engine process)."""
        return self.layout().world_size


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs, grouped by area."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None

    @property
    def scheduler_block_size(self) -> int:
        """Tokens per logical block (block hashing, allocation): block_size × DCP size."""
        return self.cache_config.block_size * self.parallel_config.decode_context_parallel_size

    def __post_init__(self) -> None:
        par, bs = self.parallel_config, self.cache_config.block_size
        interleave, kvt = par.cp_kv_cache_interleave_size, self.kv_transfer_config
        if par.decode_context_parallel_size > 1 and bs % interleave:
            raise ValueError(
                f"cp_kv_cache_interleave_size={interleave} must divide block_size={bs} (each "
                "rank's share of a logical block fills whole physical blocks)"
            )
        pcp = par.prefill_context_parallel_size
        if pcp > 1 and kvt is not None:
            check_pcp_connector(pcp, kvt)
        if pcp > 1 and self.cache_config.cache_dtype != "auto":
            raise ValueError(
                f"prefill_context_parallel_size={pcp} with kv_cache_dtype="
                f"{self.cache_config.cache_dtype} is not built yet; use --kv-cache-dtype auto"
            )
        if par.decode_context_parallel_size > 1 and kvt is not None and interleave != bs:
            raise ValueError(
                f"cp_kv_cache_interleave_size={interleave} must equal block_size={bs} when a KV "
                "connector is configured (vLLM's rule: each transferred block then lies whole on "
                f"one DCP rank); pass --cp-kv-cache-interleave-size {bs}"
            )


def check_pcp_connector(pcp: int, kvt: KVTransferConfig) -> None:
    """The KV connectors an engine with PCP (prefill_context_parallel_size = `pcp` > 1) runs:
    a P/D producer pulling mode only (P2PConnector, kv_role kv_producer, transfer_mode pull),
    whose PCP rank 0 publishes its full KV replica as a tp-1 producer would (vLLM PR #52779).

    Raises:
        ValueError: any other connector, role or transfer mode, naming what is not built.
    """
    head = f"prefill_context_parallel_size={pcp} with"
    if kvt.kv_connector != "P2PConnector":
        raise ValueError(
            f"{head} {kvt.kv_connector} is not built yet: the KV pool, CPU offload and "
            "MultiConnector would need the PCP rank and size in pool keys (issue 32); PCP runs "
            "only as a P/D producer (P2PConnector, kv_role kv_producer)")
    if kvt.kv_role != "kv_producer":
        raise ValueError(
            f"{head} kv_role={kvt.kv_role} is not built yet: a PCP engine publishes its KV as a "
            "P/D producer only (kv_role kv_producer); loading remote KV into PCP replicas (a "
            "consumer) is not built, as in vLLM")
    mode = kvt.kv_connector_extra_config.get("transfer_mode", "pull")
    if mode != "pull":
        raise ValueError(
            f"{head} P2PConnector transfer_mode={mode!r} is not built yet: a PCP producer is "
            "pulled from (transfer_mode 'pull'); pushing from its publishing rank is not built")


_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config`, with vLLM's field names.

    Attributes:
        kv_connector: registered connector name (e.g. "P2PConnector").
        kv_role: "kv_producer" (prefill), "kv_consumer" (decode) or "kv_both".
        engine_id: this engine's id in kv_transfer_params (default: a random uuid4 hex).
        kv_connector_extra_config: connector-specific settings (e.g. transfer, kv_port).
        kv_load_failure_policy: "recompute" (rerun the prefill locally) or "fail"; "" (unset)
            means the connector's default (pdkv.kv_transfer.connector.spec: "recompute" for a
            KV pool, whose loads are best effort, "fail" for P/D, vLLM's default on decode).
    """

    kv_connector: str
    kv_role: str
    engine_id: str = ""
    kv_connector_extra_config: dict[str, object] = field(default_factory=dict)
    kv_load_failure_policy: str = ""

    def __post_init__(self) -> None:
        if self.kv_role not in _KV_ROLES:
            raise ValueError(f"kv_role must be one of {_KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in ("", *_LOAD_FAILURE_POLICIES):
            raise ValueError(
                f"kv_load_failure_policy must be one of {_LOAD_FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if not self.engine_id:
            import uuid

            object.__setattr__(self, "engine_id", uuid.uuid4().hex)

    @staticmethod
    def from_json(text: str) -> KVTransferConfig:
        """Parse the CLI's JSON.

        Raises:
            ValueError: invalid JSON, unknown fields or bad values (named).
        """
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        known = {"kv_connector", "kv_role", "engine_id", "kv_connector_extra_config",
                 "kv_load_failure_policy"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown --kv-transfer-config fields {unknown}; known: {sorted(known)}"
            )
        if "kv_connector" not in data or "kv_role" not in data:
            raise ValueError("--kv-transfer-config needs kv_connector and kv_role")
        return KVTransferConfig(**data)
