"""EngineArgs: the one place where CLI flags / keyword arguments become frozen configs.

Flag names mirror vLLM's (`--block-size`, `--max-num-seqs`, `--max-num-batched-tokens`,
`--enable-prefix-caching`, `--max-model-len`, `--dtype`, ...).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

import torch

from pdkv.cache.specs import canonical_kv_cache_dtype
from pdkv.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pdkv.kv_events.config import KVEventsConfig
from pdkv.model.llama import LlamaArchConfig
from pdkv.model.registry import resolve_model
from pdkv.model.v4_config import check_v4_engine
from pdkv.worker.cuda_graphs import capture_sizes
from pdkv.worker.kv_cache import check_pcp_model, check_sliding_window_parallel


@dataclass
class EngineArgs:
    """Engine options with their defaults (see the config dataclasses for meanings)."""

    model: str = "smollm2"
    served_model_name: str | None = None
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    kv_cache_prefault: bool = False
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_mixed_prefill_tokens: int | None = None
    """None: CPU_MIXED_PREFILL_TOKENS on CPU with chunked prefill (the `pdkv bench prefill-cap`
    sweep in docs/PD.md), 0 (no cap) on CUDA and without chunked prefill."""
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    dcp_replicate_weights: bool | None = None
    prefill_context_parallel_size: int = 1
    distributed_init_port: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    num_threads: int | None = None
    kv_transfer_config: str | None = None
    kv_events_config: str | None = None
    """`--kv-events-config` JSON (pdkv.kv_events.config.KVEventsConfig, vLLM's fields)."""
    cpu_linear: str = "panel"
    attention_backend: str = "auto"
    fused_ops: bool = True
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    """vLLM's flag: no CUDA graphs for decode steps (pdkv.worker.cuda_graphs); the CPU is always
    eager."""

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model and build the configs.

        Raises:
            ValueError: unknown model, or an option out of range (message names it).
        """
        check_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
        path = resolve_model(self.model)
        arch = LlamaArchConfig.from_hf_folder(path)
        max_len = self.max_model_len or arch.max_position_embeddings
        if max_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{arch.max_position_embeddings}"
            )
        if arch.v4 is not None:
            check_v4_engine(arch.architecture, tp=self.tensor_parallel_size,
                            dcp=self.decode_context_parallel_size,
                            pcp=self.prefill_context_parallel_size,
                            kv_cache_dtype=canonical_kv_cache_dtype(self.kv_cache_dtype,
                                                                    self.dtype))
        check_sliding_window_parallel(
            arch, self.decode_context_parallel_size
        )  # before the head rules
        check_pcp_model(arch, self.prefill_context_parallel_size)
        ParallelConfig(  # vLLM's head constraints, before any process starts
            tensor_parallel_size=self.tensor_parallel_size,
            decode_context_parallel_size=self.decode_context_parallel_size,
            cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
            dcp_replicate_weights=self.dcp_replicate_weights,
            prefill_context_parallel_size=self.prefill_context_parallel_size,
        ).layout().check_heads(arch.num_heads, arch.num_kv_heads)
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but this torch build has no CUDA device")
        if device != "cpu" and not device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        return EngineConfig(
            model_config=ModelConfig(
                model=self.model,
                path=path,
                dtype=self.dtype,
                device=device,
                max_model_len=max_len,
                seed=self.seed,
                served_model_name=self.served_model_name or self.model,
                cpu_linear=self.cpu_linear,
                attention_backend=self.attention_backend,
                enforce_eager=self.enforce_eager,
                cudagraph_capture_sizes=tuple(capture_sizes(self.max_num_seqs))
                if device.startswith("cuda")
                else (),
                fused_ops=self.fused_ops,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                cache_dtype=canonical_kv_cache_dtype(self.kv_cache_dtype, self.dtype),
                prefault=self.kv_cache_prefault,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                max_mixed_prefill_tokens=default_mixed_prefill_cap(
                    self.max_mixed_prefill_tokens, device, self.enable_chunked_prefill
                ),
            ),
            kv_transfer_config=(
                KVTransferConfig.from_json(self.kv_transfer_config)
                if self.kv_transfer_config
                else None
            ),
            kv_events_config=(
                KVEventsConfig.from_json(self.kv_events_config)
                if self.kv_events_config
                else None
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                decode_context_parallel_size=self.decode_context_parallel_size,
                cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
                dcp_replicate_weights=self.dcp_replicate_weights,
                prefill_context_parallel_size=self.prefill_context_parallel_size,
                distributed_init_port=self.distributed_init_port,
                nnodes=self.nnodes,
                node_rank=self.node_rank,
                master_addr=self.master_addr,
                master_port=self.master_port,
            ),
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags (vLLM names) to `parser`."""
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--model",
            default=d.model,
            help="alias (smollm2: the real model; tiny-llama-kv1, tiny-llama-kv2, tiny-swa, "
            "tiny-mla, tiny-gdn, tiny-kda-mla, tiny-v4: random-weight models for parity tests), "
            "HF id (resolved offline: the HF cache) or HF folder",
        )
        g.add_argument(
            "--served-model-name",
            nargs="+",
            default=None,
            help="model id(s) clients may use; the first is reported (unset: the model value)",
        )
        g.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"],
                       help="weights, activations and KV cache")
        g.add_argument("--device", default=None, help="cpu | cuda[:N] (unset: cuda if present)")
        g.add_argument("--seed", type=int, default=d.seed, help="engine seed for random sampling")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (unset: the model's)")
        g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
        g.add_argument(
            "--num-kv-blocks",
            type=int,
            default=None,
            help="KV blocks (unset: from --kv-cache-memory-bytes)",
        )
        g.add_argument(
            "--kv-cache-memory-bytes",
            type=int,
            default=d.kv_cache_memory_bytes,
            help="KV cache budget when neither --num-kv-blocks nor --gpu-memory-utilization "
            "is given",
        )
        g.add_argument(
            "--kv-cache-prefault",
            action="store_true",
            help="CPU: write the whole KV cache at start, so its memory is resident (RSS at its "
            "steady state) from the start instead of growing as blocks are first used",
        )
        g.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=None,
            help="KV cache = this fraction of the memory free after loading the weights (GPU: free "
            "device memory; CPU: available RAM), unless --num-kv-blocks is given",
        )
        g.add_argument(
            "--kv-cache-dtype",
            default=d.kv_cache_dtype,
            help="auto = the model dtype (--dtype); int8 or fp8 (= fp8_e4m3): 1 byte per value "
            "plus a float32 scale per token and KV head (K and V)",
        )
        g.add_argument(
            "--enforce-eager",
            action="store_true",
            help="no CUDA graphs for decode steps (default on CUDA: graphs for batch sizes 1, "
            "2, 4, 8, 16, ... up to --max-num-seqs; the CPU always runs eagerly)",
        )
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=d.enable_prefix_caching,
            help="reuse the KV blocks of a cached prompt prefix (block hashes, as vLLM's "
            "automatic prefix caching)",
        )
        g.add_argument(
            "--max-num-seqs", type=int, default=d.max_num_seqs, help="requests running at once"
        )
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="token budget of one engine step")
        g.add_argument(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=d.enable_chunked_prefill,
        )
        g.add_argument(
            "--max-mixed-prefill-tokens",
            type=int,
            default=d.max_mixed_prefill_tokens,
            help="most prompt tokens in a step that also runs decodes (0 = no cap; default "
            f"{CPU_MIXED_PREFILL_TOKENS} on CPU, 0 on CUDA): bounds the inter-token latency "
            "tail behind long prefills",
        )
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="TP ranks: one worker process each (torch.distributed, gloo on CPU)")
        g.add_argument(
            "--decode-context-parallel-size",
            "-dcp",
            type=int,
            default=1,
            help="DCP ranks sharing each request's KV; carved out of TP (vLLM) when tp > 1, "
            "ranks that replicate the weights when tp is 1",
        )
        g.add_argument(
            "--cp-kv-cache-interleave-size",
            type=int,
            default=d.cp_kv_cache_interleave_size,
            help="consecutive tokens stored on one DCP rank (must equal --block-size with a "
            "KV connector)",
        )
        g.add_argument(
            "--dcp-replicate-weights",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="DCP ranks each hold a whole TP shard (world size tp x dcp); default: only "
            "when tp is 1",
        )
        g.add_argument(
            "--prefill-context-parallel-size",
            "-pcp",
            type=int,
            default=d.prefill_context_parallel_size,
            help="PCP ranks (one worker process each, the whole model and a full KV replica on "
            "each): long prefill runs of a step are split over them head-tail (tp 1, dcp 1, no "
            "KV connector; docs/PARALLEL_TIERS.md)",
        )
        g.add_argument(
            "--distributed-init-port",
            type=int,
            default=d.distributed_init_port,
            help="127.0.0.1 port of the workers' torch.distributed rendezvous (0: a free one)",
        )
        g.add_argument("--nnodes", type=int, default=d.nnodes,
                       help="hosts the TP/DCP ranks are spread over, evenly (vLLM's flag)")
        g.add_argument("--node-rank", type=int, default=d.node_rank,
                       help="this host's node rank: 0 runs the engine, the others --headless")
        g.add_argument("--master-addr", default=d.master_addr,
                       help="with --nnodes > 1: the node-rank-0 host's address (torch.distributed "
                       "rendezvous and the workers' control channels)")
        g.add_argument("--master-port", type=int, default=d.master_port,
                       help="with --nnodes > 1: torch.distributed's port on the master address; "
                       "the next port takes the workers' control channels")
        g.add_argument(
            "--cpu-linear",
            default=d.cpu_linear,
            choices=["panel", "onednn", "auto", "torch"],
            help="CPU matmuls: panel (float32 / bfloat16 weights packed for pdkv's AVX2 "
            "kernel; else onednn), onednn (oneDNN's packed weights), auto (one weight copy; "
            "BLAS or oneDNN per row count from a table timed at start-up and logged) or torch "
            "(BLAS)",
        )
        g.add_argument(
            "--attention-backend",
            default=d.attention_backend,
            choices=["auto", "torch", "cpu_paged"],
            help="decode attention: torch (gather blocks + SDPA) or cpu_paged (C++ op reading "
            "K/V from the blocks in place); auto = cpu_paged on CPU when built (make "
            "setup), torch for CUDA, quantized KV, DCP and MLA",
        )
        g.add_argument(
            "--fused-ops",
            action=argparse.BooleanOptionalAction,
            default=d.fused_ops,
            help="C++ fused RMSNorm / residual add / RoPE / SiLU-mul on CPU float32 when "
            "built (make setup); --no-fused-ops: the torch ops (reference path)",
        )
        g.add_argument(
            "--kv-transfer-config",
            default=None,
            help="KV connector JSON, e.g. "
            '\'{"kv_connector": "P2PConnector", "kv_role": "kv_producer"}\'',
        )
        g.add_argument(
            "--kv-events-config",
            default=None,
            help="KV cache events JSON (vLLM's KVEventsConfig fields; off by default, endpoints "
            'bind loopback by default), e.g. \'{"enable_kv_cache_events": true, "endpoint": '
            '"tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": '
            '"kv-events"}\'',
        )
        g.add_argument(
            "--num-threads",
            type=int,
            default=None,
            help="torch CPU threads (unset: $PDKV_NUM_THREADS or torch's choice)",
        )
        return parser

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> EngineArgs:
        """EngineArgs from parsed flags: `pdkv serve MODEL` (model_tag) sets the model, a list of
        served model names keeps its first (the reported one).

        Raises:
            ValueError: MODEL and a different --model both given.
        """
        names = {f.name for f in fields(EngineArgs)}
        kwargs = {k: v for k, v in vars(args).items() if k in names}
        tag = getattr(args, "model_tag", None)
        if tag:  # `pdkv serve MODEL`
            if kwargs.get("model") not in (None, EngineArgs.model, tag):
                raise ValueError(
                    f"two models given: MODEL {tag!r} and --model {kwargs['model']!r}; give one"
                )
            kwargs["model"] = tag
        if isinstance(
            kwargs.get("served_model_name"), list
        ):  # several names: the first is reported
            kwargs["served_model_name"] = kwargs["served_model_name"][0]
        return EngineArgs(**kwargs)

    def summary(self) -> str:
        """The options as `name=value` pairs, for the startup log."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))

    def apply_threads(self) -> None:
        """Set torch's CPU thread count when asked (flag or $PDKV_NUM_THREADS)."""
        n = self.num_threads or int(os.environ.get("PDKV_NUM_THREADS", "0"))
        if n > 0:
            torch.set_num_threads(n)


CPU_MIXED_PREFILL_TOKENS = 64
"""Default prefill cap of mixed steps on CPU: in `pdkv bench prefill-cap --caps 0,32,64` (SmolLM2,
2 threads, 512-token prompts at 0.5 req/s, docs/PD.md "Prefill cap of mixed steps") 64 brought
ITL p99 / TPOT mean from 12 to 1.8 with TTFT 0.89x the uncapped run's; 32 cost 1.55x TTFT."""


def default_mixed_prefill_cap(value: int | None, device: str, chunked_prefill: bool) -> int:
    """`--max-mixed-prefill-tokens` as given, else CPU_MIXED_PREFILL_TOKENS on CPU with chunked
    prefill and 0 (no cap) otherwise: a GPU runs a prefill chunk next to decodes at little cost,
    vLLM applies no such cap by default."""
    if value is not None:
        return value
    return CPU_MIXED_PREFILL_TOKENS if device == "cpu" and chunked_prefill else 0


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> None:
    """Raises ValueError unless `kv_cache_dtype` is "auto", the model dtype itself, "int8", "fp8"
    or "fp8_e4m3" (pdkv.cache.specs.canonical_kv_cache_dtype)."""
    canonical_kv_cache_dtype(kv_cache_dtype, dtype)
