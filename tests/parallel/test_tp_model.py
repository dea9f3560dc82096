"""Tensor parallelism of the Llama model: per-rank weight shards read from safetensors, and tp 2
over two gloo processes giving the single-rank logits (prefill and one decode step)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch

from pdkv.model.attention import AttentionMetadata, PrefillSeq
from pdkv.model.llama import LlamaForCausalLM
from pdkv.model.loader import load_model
from pdkv.parallel.context import ParallelContext, init_distributed
from pdkv.parallel.layout import ParallelLayout

HIDDEN, HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 64, 4, 16, 128, 2, 512
BLOCK, NUM_BLOCKS, PROMPT_LEN = 16, 4, 20
JOIN_DEADLINE_S = 120.0


def _build_tiny_llama(path: str, num_kv_heads: int, num_heads: int = HEADS) -> str:
    """A random Llama (transformers init, initializer_range 0.2 for wide greedy margins) saved as
    safetensors in `path`."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(num_kv_heads)
    cfg = LlamaConfig(
        hidden_size=HEAD_DIM * num_heads,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        head_dim=HEAD_DIM,
        initializer_range=0.2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    HFLlama(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[int, str]:
    """KV heads -> folder of a random 4-head Llama."""
    root = tmp_path_factory.mktemp("tiny_tp")
    return {kvh: _build_tiny_llama(str(root / f"kv{kvh}"), kvh) for kvh in (1, 2)}


def _meta(positions: list[int], decode: bool) -> AttentionMetadata:
    """One request whose blocks are 0..NUM_BLOCKS-1: a prefill run from 0, or one decode token."""
    table = torch.arange(NUM_BLOCKS)
    pos = torch.tensor(positions)
    blocks, offsets = table[pos // BLOCK], pos % BLOCK
    if not decode:
        return AttentionMetadata(
            blocks, offsets, [PrefillSeq(0, len(positions), 0, table)], None, None, None, None
        )
    seq_len = torch.tensor([positions[-1] + 1])
    return AttentionMetadata(
        blocks,
        offsets,
        [],
        torch.tensor([0]),
        table[None],
        seq_len,
        None,
        all_decode=True,
        decode_seq_lens_cpu=(positions[-1] + 1,),
    )


def _prompt() -> list[int]:
    return [(37 * i + 11) % VOCAB for i in range(PROMPT_LEN)]


def _run(
    model: LlamaForCausalLM, next_token: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prefill of the prompt (logits of every position), then one decode step of `next_token`
    (default: the prefill's greedy token). Returns (prefill logits, decode logits, token)."""
    cfg = model.cfg
    caches = [
        torch.zeros(2, NUM_BLOCKS, BLOCK, model.num_local_kv_heads, cfg.head_dim)
        for _ in range(cfg.num_layers)
    ]
    with torch.inference_mode():
        ids = torch.tensor(_prompt())
        pos = list(range(PROMPT_LEN))
        prefill = model(ids, torch.tensor(pos), caches, _meta(pos, False), torch.arange(PROMPT_LEN))
        tok = int(prefill[-1].argmax()) if next_token is None else next_token
        decode = model(
            torch.tensor([tok]),
            torch.tensor([PROMPT_LEN]),
            caches,
            _meta([PROMPT_LEN], True),
            torch.tensor([0]),
        )
    return prefill, decode, tok


def _worker(rank: int, init_methods: list[str], paths: list[str], out_dir: str) -> None:
    """Child process, rank `rank` of two: tp 2 logits per model, then (a fresh world) dcp 2 with
    replicated weights gathering [rank, rank] rows; writes its results as safetensors."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    ctx = init_distributed(ParallelLayout(tp_size=2), rank, init_methods[0], timeout_s=60)
    try:
        for i, path in enumerate(paths):
            prefill, decode, tok = _run(load_model(path, "float32", "cpu", ctx))
            save_file({"prefill": prefill, "decode": decode, "token": torch.tensor([tok])},
                      os.path.join(out_dir, f"m{i}_r{rank}.safetensors"))
    finally:
        ctx.destroy()
    ctx = init_distributed(
        ParallelLayout(dcp_size=2, dcp_replicated=True), rank, init_methods[1], timeout_s=60
    )
    try:
        x = torch.full((1, 2), float(ctx.dcp_rank))
        out = {"gathered": ctx.all_gather_dcp(x, dim=0), "reduced": ctx.all_reduce_tp(x.clone())}
        save_file(out, os.path.join(out_dir, f"dcp_r{rank}.safetensors"))
    finally:
        ctx.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tp2_logits_match_single_rank(tiny_models, tmp_path):
    """Two gloo processes at tp 2 give the single-rank logits (prefill and decode) for 1 and 2 KV
    heads; the same two processes then check all_gather_dcp at dcp 2."""
    from safetensors.torch import load_file

    paths = [tiny_models[1], tiny_models[2]]
    init_methods = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, init_methods, paths, str(tmp_path))) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(JOIN_DEADLINE_S)
        assert [p.exitcode for p in procs] == [0, 0], "a tp rank failed or missed the deadline"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    for i, path in enumerate(paths):
        prefill, _, tok = _run(load_model(path, "float32", "cpu"))
        top2 = prefill.topk(2, dim=-1).values
        assert (
            float((top2[:, 0] - top2[:, 1]).min()) > 1e-3
        )  # greedy margins well above the tolerance
        _, decode, _ = _run(load_model(path, "float32", "cpu"), tok)
        for r in range(2):
            got = load_file(str(tmp_path / f"m{i}_r{r}.safetensors"))
            torch.testing.assert_close(got["prefill"], prefill, atol=1e-4, rtol=0)
            assert torch.equal(got["prefill"].argmax(-1), prefill.argmax(-1))
            assert int(got["token"]) == tok
            torch.testing.assert_close(got["decode"], decode, atol=1e-4, rtol=0)
            assert int(got["decode"].argmax()) == int(decode.argmax())
    for r in range(2):
        got = load_file(str(tmp_path / f"dcp_r{r}.safetensors"))
        assert torch.equal(
            got["gathered"], torch.tensor([[0.0, 0.0], [1.0, 1.0]])
        )  # DCP-rank order
        assert torch.equal(got["reduced"], torch.full((1, 2), float(r)))  # tp 1: identity


@pytest.mark.parametrize("kvh", [1, 2])
def test_each_rank_reads_its_shard(tiny_models, kvh):
    """Shard shapes and contents per rank (a hand-built context: loading needs no process group)."""
    full = load_model(tiny_models[kvh], "float32", "cpu")
    q, kv, i = HEADS * HEAD_DIM, kvh * HEAD_DIM, INTER
    fl = full.layers[1]
    for rank in range(2):
        m = load_model(
            tiny_models[kvh], "float32", "cpu", ParallelContext(ParallelLayout(tp_size=2), rank)
        )
        assert m.num_local_kv_heads == 1  # kvh 1: replicated; kvh 2: one each
        layer = m.layers[1]
        assert tuple(layer.qkv.shape) == (q // 2 + 2 * HEAD_DIM, HIDDEN)
        assert tuple(layer.o_proj.shape) == (HIDDEN, q // 2)
        assert tuple(layer.gate_up.shape) == (i, HIDDEN)
        assert tuple(layer.down.shape) == (HIDDEN, i // 2)
        qs = slice(rank * q // 2, (rank + 1) * q // 2)
        kv_head = 0 if kvh == 1 else rank
        ks = slice(q + kv_head * HEAD_DIM, q + (kv_head + 1) * HEAD_DIM)
        vs = slice(q + kv + kv_head * HEAD_DIM, q + kv + (kv_head + 1) * HEAD_DIM)
        assert torch.equal(layer.qkv, torch.cat([fl.qkv[qs], fl.qkv[ks], fl.qkv[vs]]))
        assert torch.equal(layer.o_proj, fl.o_proj[:, qs])
        ir = slice(rank * i // 2, (rank + 1) * i // 2)
        assert torch.equal(layer.gate_up, torch.cat([fl.gate_up[ir], fl.gate_up[i:][ir]]))
        assert torch.equal(layer.down, fl.down[:, ir])
        assert (
            torch.equal(m.embed, full.embed)
            and m.lm_head is not None
            and torch.equal(m.lm_head, full.lm_head)
        )


@pytest.mark.parametrize("heads,inter,message", [
    (3, INTER, "tensor_parallel_size=2 must divide the model's 3 attention heads"),
    (4, 129, "tensor_parallel_size=2 must divide the model's intermediate_size=129"),
])
def test_layout_error_reaches_load_model(tmp_path, heads, inter, message):
    """The layout checks run before any weight is read: a config.json alone is enough."""
    import json

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": heads * HEAD_DIM,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path), "float32", "cpu", ParallelContext(ParallelLayout(tp_size=2), 0))
