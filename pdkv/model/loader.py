"""Load an HF-format safetensors folder into `LlamaForCausalLM` (fusing q/k/v and gate/up), an
MLA config into `pdkv.model.deepseek.DeepseekV3ForCausalLM`, or a Qwen3-Next config into
`pdkv.model.qwen3_next.Qwen3NextForCausalLM`, or a Kimi-Linear config into
`pdkv.model.kimi_linear.KimiLinearForCausalLM` (each its own weight map).

With tensor parallelism each rank reads only its shard through safetensors' lazy slices
(`get_slice(name)[rows]`, `[:, cols]`), as vLLM's weight loaders do: q rows of its heads, k / v
rows of its KV heads (replicated when tp exceeds them), o_proj columns of its heads, gate / up rows
and down columns of its slice of the intermediate size; embedding, norms and LM head whole.
"""

from __future__ import annotations

import glob
import hashlib
import json
import mmap
import os
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import safe_open

from pdkv.model.llama import LlamaArchConfig, LlamaForCausalLM
from pdkv.parallel.context import ParallelContext

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def load_model(
    path: str, dtype: str, device: str, parallel: ParallelContext | None = None
) -> LlamaForCausalLM:
    """Build the model (this rank's shard of it) from `path` (config.json + *.safetensors) in
    `dtype` on `device`.

    Args:
        parallel: this rank's TP / DCP context; None for one process (the whole model).

    Raises:
        ValueError: unsupported architecture; a layout that does not fit the model's heads or
            intermediate size (ParallelLayout.check_heads, named values); a missing / mis-shaped
            weight (named).
    """
    cfg = LlamaArchConfig.from_hf_folder(path)
    ctx = parallel or ParallelContext.single()
    if not cfg.has_linear_state:
        ctx.layout.check_heads(cfg.num_heads, cfg.num_kv_heads)
    tdtype = TORCH_DTYPES[dtype]
    dev = torch.device(device)

    def put(param: torch.nn.Parameter, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(
                f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}"
            )
        # float32 parameters (DeepSeek-V4's norms, sinks, mHC and biases) stay float32
        param.data.copy_(value.to(param.dtype if param.dtype == torch.float32 else tdtype))

    if cfg.v4 is not None:  # DeepseekV4ForCausalLM (pdkv/model/deepseek_v4.py)
        from pdkv.model.deepseek_v4 import DeepseekV4ForCausalLM

        v4 = DeepseekV4ForCausalLM(cfg, tdtype, dev, parallel)
        with _ShardReader(path) as r:
            v4.load_weights(r, put)
            _check_all_read(path, r)
        return v4.to(dev).eval()
    if cfg.has_linear_state and cfg.is_mla:  # KimiLinearForCausalLM (pdkv/model/kimi_linear.py)
        from pdkv.model.kimi_linear import KimiLinearForCausalLM

        kda = KimiLinearForCausalLM(cfg, tdtype, dev, parallel)
        with _ShardReader(path) as r:
            kda.load_weights(r, put)
            _check_all_read(path, r)
        return kda.to(dev).eval()
    if cfg.has_linear_state:  # Qwen3NextForCausalLM (pdkv/model/qwen3_next.py)
        from pdkv.model.qwen3_next import Qwen3NextForCausalLM

        gdn = Qwen3NextForCausalLM(cfg, tdtype, dev, parallel)
        with _ShardReader(path) as r:
            gdn.load_weights(r, put)
            _check_all_read(path, r)
        return gdn.to(dev).eval()
    if cfg.is_mla:  # DeepseekV3ForCausalLM (pdkv/model/deepseek.py)
        from pdkv.model.deepseek import DeepseekV3ForCausalLM

        mla = DeepseekV3ForCausalLM(cfg, tdtype, dev, ctx)
        with _ShardReader(path) as r:
            mla.load_weights(r, put)
            _check_all_read(path, r)
        return mla.to(dev).eval()
    model = LlamaForCausalLM(cfg, tdtype, dev, ctx)
    tp, tp_rank, d = ctx.tp_size, ctx.tp_rank, cfg.head_dim
    heads = cfg.num_heads // tp
    q_rows = slice(tp_rank * heads * d, (tp_rank + 1) * heads * d)
    kv_start = ctx.layout.kv_head_start(ctx.rank, cfg.num_kv_heads)
    kv_rows = slice(kv_start * d, (kv_start + model.num_local_kv_heads) * d)
    inter = cfg.intermediate_size // tp
    i_rows = slice(tp_rank * inter, (tp_rank + 1) * inter)

    with _ShardReader(path) as r:
        mapped = r.mapped("model.embed_tokens.weight", tdtype) if dev.type == "cpu" else None
        if mapped is not None and tuple(mapped[0].shape) == tuple(model.embed.shape):
            model.embed = torch.nn.Parameter(mapped[0], requires_grad=False)
            model.embed_file_map = mapped[1]
            r.skip("model.embed_tokens.weight")
        else:
            put(model.embed, r.whole("model.embed_tokens.weight"), "embed_tokens")
        put(model.norm, r.whole("model.norm.weight"), "norm")
        if model.lm_head is not None:
            put(model.lm_head, r.whole("lm_head.weight"), "lm_head")
        else:
            r.skip("lm_head.weight")
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            put(layer.input_norm, r.whole(p + "input_layernorm.weight"), p + "input_layernorm")
            put(
                layer.post_attn_norm,
                r.whole(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm",
            )
            rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
            put(
                layer.qkv,
                torch.cat([r.rows(a + f"{n}_proj.weight", rows[n]) for n in "qkv"]),
                p + "qkv",
            )
            if layer.qkv_bias is not None:
                bias = torch.cat([r.rows(a + f"{n}_proj.bias", rows[n]) for n in "qkv"])
                put(layer.qkv_bias, bias, p + "qkv_bias")
            put(layer.o_proj, r.cols(a + "o_proj.weight", q_rows), p + "o_proj")
            m = p + "mlp."
            gate_up = torch.cat(
                [r.rows(m + "gate_proj.weight", i_rows), r.rows(m + "up_proj.weight", i_rows)]
            )
            put(layer.gate_up, gate_up, p + "gate_up")
            put(layer.down, r.cols(m + "down_proj.weight", i_rows), p + "down_proj")
        _check_all_read(path, r)
    return model.to(dev).eval()


def _check_all_read(path: str, r: _ShardReader) -> None:
    """Raises ValueError when `r` holds weights nobody read (rotary buffers aside)."""
    leftovers = [k for k in r.unread() if "rotary_emb" not in k]
    if leftovers:
        raise ValueError(f"unexpected weights in {path}: {leftovers[:5]}")


class _ShardReader:
    """Lazy reads from every *.safetensors file of a folder: whole tensors, row ranges or column
    ranges (only those bytes are read); remembers which names were not read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            raise ValueError(f"no *.safetensors files in {path}")
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}
        self._stack_files: dict[str, Any] = {}

    def __enter__(self) -> _ShardReader:
        for fname in self.files:
            f = self._stack.enter_context(safe_open(fname, framework="pt"))
            self._stack_files[fname] = f
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._where[key] = f
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _handle(self, name: str) -> Any:
        try:
            return self._where.pop(name)
        except KeyError:
            raise ValueError(f"weight {name!r} missing from {self.path}") from None

    def whole(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)  # type: ignore[no-any-return]

    def rows(self, name: str, rows: slice) -> torch.Tensor:
        """Rows `rows` of a weight [out, in] (or entries of a bias [out])."""
        return self._handle(name).get_slice(name)[rows]  # type: ignore[no-any-return]

    def cols(self, name: str, cols: slice) -> torch.Tensor:
        """Columns `cols` of a weight [out, in]."""
        return self._handle(name).get_slice(name)[:, cols]  # type: ignore[no-any-return]

    def mapped(self, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap] | None:
        """Weight `name` as a tensor over a private (copy-on-write) memory map of its file (and
        the map), or None when the file stores another dtype. Nothing is read here: a page of
        the file enters the resident set when first read, so a lookup table (the embedding)
        holds only the rows that were looked up, and its memory is page cache the kernel may
        drop."""
        handle = self._where.get(name)
        if handle is None:
            return None
        fname = next(f for f in self.files if self._stack_files.get(f) is handle)
        with open(fname, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            info = json.loads(f.read(header_len))[name]
            if _SAFETENSORS_DTYPES.get(info["dtype"]) != dtype:
                return None
            start, end = info["data_offsets"]
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        count = (end - start) // dtype.itemsize
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + header_len + start).view(
            info["shape"]
        ), mm

    def skip(self, name: str) -> None:
        self._where.pop(name, None)

    def unread(self) -> list[str]:
        return list(self._where)


def model_digest(path: str) -> str:
    """Short sha256 over config.json and the safetensors headers + sizes: identifies the
    weights (for KV compatibility checks) without reading every byte."""
    h = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(json.dumps(json.load(f), sort_keys=True).encode())
    for fname in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(fname, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
        h.update(str(os.path.getsize(fname)).encode())
    return h.hexdigest()[:16]
