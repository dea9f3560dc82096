"""Whether a P2P consumer can take a producer's blocks (torch-free): the layout checks of D's
scheduler half beyond the identity fields (`layout_mismatch`): producer and consumer TP / DCP sizes,
KV-head sharding, block size conversion and KV cache groups. Each returns "" when the pair
converts, else a message naming both values (issue 12 builds what is refused)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeGuard

from pdkv.cache.specs import QUANTIZED_KV_CACHE_DTYPES
from pdkv.jsontypes import as_int
from pdkv.kv_transfer.connector.p2p_messages import conversion_error, params_layout
from pdkv.kv_transfer.reshard import plan_head_reads
from pdkv.kv_transfer.reshard_state import StateGeometry, plan_state_reads

if TYPE_CHECKING:
    from pdkv.request import Request

MLA_KV_LAYOUT = "blocks_layers_tokens_latent"
"""`kv_layout` of an engine whose KV cache is one MLA group (pdkv.worker.model_runner)."""


def mla_error(layout: Mapping[str, object], p: Mapping[str, object]) -> str:
    """Why this MLA engine cannot take the producer's blocks, or "". An MLA block is
    [layers, block_size, kv_lora_rank + qk_rope_head_dim]: no K/V halves and no heads, and every
    TP rank holds the whole latent (replicated), so each decode rank reads whole blocks from one
    producer rank: a producer at tp 1 into any decode tp works; re-blocking (which maps K and V
    rows by token) and producers at tp > 1 are refused."""
    theirs = params_layout(p)
    if layout.get("block_size") != theirs.get("block_size"):
        return (
            f"decode block_size={layout.get('block_size')} differs from the producer's "
            f"block_size={theirs.get('block_size')} on an MLA model: re-blocking maps K/V rows and "
            "is not supported for latent blocks; use equal block sizes"
        )
    if p.get("tp_size", 1) != 1:
        return (
            f"a producer at tp_size={p.get('tp_size')} on an MLA model is not supported: the "
            "latent is replicated on every rank, so run the producer at tp 1 (each decode rank "
            "then reads whole blocks from it)"
        )
    return ""


def _is_count(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def params_consistency_error(p: Mapping[str, object], num_tokens: int,
                             linear_groups: tuple[bool, ...]) -> str:
    """Why a remote prefill's kv_transfer_params contradict themselves, or "": checked at
    admission, before any claim is sent or block allocated, so params that were forged or
    corrupted on the way are a 400 naming the field, not a failed load.

    What a producer sends (P2PSchedulerConnector.request_finished): `layout.block_size` a
    positive integer, equal to the params' own `block_size` when present; `remote_block_ids` one
    list of non-negative block ids per KV cache group,
    ceil(num_tokens / layout.block_size) of them in each attention group (a sliding-window
    group's blocks before its window are the null block, still listed) and one state slot in each
    linear-attention group.

    Args:
        p: the params (`remote_block_ids` already one list per group).
        num_tokens: the prompt's tokens (the params' `num_tokens` must equal it).
        linear_groups: per KV cache group, whether it holds linear-attention state.
    """
    layout = p.get("layout")
    if not isinstance(layout, dict):
        return f"kv_transfer_params.layout must be an object, got {layout!r:.60}"
    bs = layout.get("block_size")
    if not _is_count(bs) or bs == 0:
        return f"kv_transfer_params.layout.block_size must be a positive integer, got {bs!r:.40}"
    top = p.get("block_size", bs)
    if top != bs:
        return (
            f"kv_transfer_params.block_size={top!r:.20} and layout.block_size={bs} differ: a "
            "producer sends the same block size in both"
        )
    expected = -(-num_tokens // bs)
    groups = p["remote_block_ids"]
    if not isinstance(groups, list | tuple):
        return ("kv_transfer_params.remote_block_ids must be a list of block lists, "
                f"got {groups!r:.60}")
    for g, (ids, linear) in enumerate(zip(groups, linear_groups)):
        if not isinstance(ids, list) or not all(_is_count(b) for b in ids):
            return (f"kv_transfer_params.remote_block_ids[{g}] must be a list of non-negative "
                    f"integer block ids, got {ids!r:.60}")
        want = 1 if linear else expected
        if len(ids) != want:
            what = ("one linear-state slot" if linear else
                    f"ceil({num_tokens} tokens / layout.block_size {bs}) = {expected} blocks")
            return (
                f"kv_transfer_params.remote_block_ids[{g}] lists {len(ids)} blocks but the params "
                f"describe {what}: block ids, num_tokens and layout.block_size disagree"
            )
    return ""


def shard_error(layout: Mapping[str, object], p: Mapping[str, object], num_groups: int) -> str:
    """Why this engine cannot take the producer's blocks, or "". P must be dcp 1. A P at tp 1:
    each of this engine's ranks stores either exactly P's KV heads (whole blocks; with DCP,
    block size conversion, or KV replicated over TP ranks) or a subset of them (re-sharding,
    issue 12: each rank reads its heads; not combined with DCP or a block size change). A P
    at tp > 1: this engine has no DCP and P's block size (`_producer_tp_error`)."""
    mine, theirs = layout, params_layout(p)
    my_tp, my_dcp = as_int(mine.get("tp_size", 1)), as_int(mine.get("dcp_size", 1))
    if MLA_KV_LAYOUT in (mine.get("kv_layout"), theirs.get("kv_layout")):
        return mla_error(layout, p)
    error = quantized_conversion_error(mine, p) or state_error(mine, p)
    if error:
        return error
    if p.get("dcp_size", 1) != 1:
        return (f"a producer with DCP (producer dcp_size={p.get('dcp_size')!r}, consumer "
                f"dcp_size={my_dcp}) is not supported yet (issue 12)")
    if p.get("tp_size", 1) != 1:
        return producer_tp_error(layout, p)
    my_heads = mine.get("num_local_kv_heads", mine.get("num_kv_heads"))
    if my_heads != theirs.get("num_kv_heads"):  # this rank stores a subset of P's heads
        if my_dcp > 1:
            return (
                f"each decode rank stores {my_heads} of the producer's "
                f"{theirs.get('num_kv_heads')} KV heads (tp_size={my_tp}) and "
                f"decode_context_parallel_size={my_dcp}: re-sharding KV heads into a DCP decode "
                "engine is not supported (issue 12)"
            )
        if mine.get("block_size") != theirs.get("block_size"):
            return (
                f"each decode rank stores {my_heads} of the producer's "
                f"{theirs.get('num_kv_heads')} KV heads (tp_size={my_tp}) and decode "
                f"block_size={mine.get('block_size')} differs from the producer's "
                f"block_size={theirs.get('block_size')}: re-sharding and re-blocking at once is "
                "not supported (issue 12)"
            )
        return ""
    converting = conversion_error(mine, theirs)
    if converting:
        return converting
    if mine.get("block_size") != theirs.get("block_size") and num_groups != 1:
        return (f"decode block_size={mine.get('block_size')} differs from the producer's "
                f"block_size={theirs.get('block_size')}: re-blocking needs one KV cache group "
                f"(this engine has {num_groups})")
    return ""


def quantized_conversion_error(layout: Mapping[str, object], p: Mapping[str, object]) -> str:
    """Why blocks of a quantized KV cache (kv_cache_dtype int8 / fp8_e4m3) cannot be converted
    between this engine and the producer, or "". With equal dtypes every conversion of the
    plain layout applies: whole blocks, DCP shards, re-blocking and KV-head re-sharding (the
    planners address each plane of the page: 1-byte values, then float32 scales per (token,
    head); pdkv/kv_transfer/reblock.py, reshard.py). A quantized producer into an unquantized
    engine is dequantized on arrival from P's whole blocks (`ReadPlanner.dequant_ops`): not
    together with re-blocking, re-sharding or DCP."""
    mine, theirs = layout, params_layout(p)
    dtype = mine.get("kv_cache_dtype", "auto")
    p_dtype = theirs.get("kv_cache_dtype", "auto")
    if not (
        dtype == "auto" and p_dtype in QUANTIZED_KV_CACHE_DTYPES
    ):  # equal dtypes, or refused elsewhere
        return ""
    head = f"producer kv_cache_dtype={p_dtype!r} into decode kv_cache_dtype={dtype!r}"
    why = "dequantizing on arrival takes the producer's whole blocks at equal layouts"
    if as_int(mine.get("dcp_size", 1)) > 1:
        return (
            f"{head} with decode_context_parallel_size={mine.get('dcp_size')}: dequantizing into a "
            "DCP decode engine is not supported"
        )
    if mine.get("block_size") != theirs.get("block_size"):
        return (
            f"{head} with decode block_size={mine.get('block_size')} and the producer's "
            f"block_size={theirs.get('block_size')}: re-blocking while dequantizing is not "
            f"supported ({why})"
        )
    my_heads = mine.get("num_local_kv_heads", mine.get("num_kv_heads"))
    if p.get("tp_size", 1) != 1 or my_heads != theirs.get("num_kv_heads"):
        return (
            f"{head} from producer tp_size={p.get('tp_size', 1)} "
            f"({theirs.get('num_kv_heads')} KV heads) into tp_size={mine.get('tp_size', 1)} "
            f"({my_heads} KV heads per rank): re-sharding while dequantizing is not supported "
            f"({why})"
        )
    return ""


def state_error(layout: Mapping[str, object], p: Mapping[str, object]) -> str:
    """Why this engine cannot rebuild its share of the producer's linear-state slot (Gated
    DeltaNet), or "": equal TP sizes move whole slots; different ones need the same state geometry
    on both sides and both TP sizes dividing each conv segment and the value heads
    (pdkv/kv_transfer/reshard_state.py)."""
    my_tp, p_tp = as_int(layout.get("tp_size", 1)), p.get("tp_size", 1)
    try:
        mine = StateGeometry.from_layout(layout)
        theirs = StateGeometry.from_layout(params_layout(p))
    except ValueError as e:
        return str(e)
    if mine is None or my_tp == p_tp:
        return ""
    if theirs != mine:
        return (
            f"producer tp_size={p_tp} into consumer tp_size={my_tp}: the producer's linear-state "
            f"geometry {theirs} differs from this engine's {mine}: its state slot cannot be "
            "re-sharded"
        )
    try:
        plan_state_reads(mine, as_int(p_tp), my_tp)
    except (TypeError, ValueError) as e:
        return (
            f"re-sharding the linear-state slot from producer tp_size={p_tp} to consumer "
            f"tp_size={my_tp}: {e}"
        )
    return ""


def producer_tp_error(layout: Mapping[str, object], p: Mapping[str, object]) -> str:
    """Why this engine cannot take blocks from a producer at tp > 1, or "" (this engine has
    no DCP, P's block size, heads both TP sizes divide, one endpoint per P rank)."""
    mine, theirs = layout, params_layout(p)
    my_tp, my_dcp, p_tp = as_int(mine.get("tp_size", 1)), as_int(mine.get("dcp_size",
                                                                          1)), p.get("tp_size")
    if not isinstance(p_tp, int) or p_tp < 1:
        return f"kv_transfer_params.tp_size must be a positive integer, got {p_tp!r}"
    if my_dcp > 1:
        return (
            f"a prefill engine at tp_size={p_tp} into a DCP decode engine (consumer "
            f"tp_size={my_tp}, decode_context_parallel_size={my_dcp}) is not supported: P must "
            "run tp 1 for P/D into DCP (issue 12)"
        )
    if mine.get("block_size") != theirs.get("block_size"):
        return (
            f"a prefill engine at tp_size={p_tp} with block_size={theirs.get('block_size')} and "
            f"decode block_size={mine.get('block_size')} (consumer tp_size={my_tp}): re-sharding "
            "from a multi-rank producer and re-blocking at once is not supported (issue 12)"
        )
    endpoints = p.get("endpoints")
    if (not isinstance(endpoints, list) or len(endpoints) != p_tp
            or not all(isinstance(e, list | tuple) and len(e) == 2 for e in endpoints)):
        return (f"kv_transfer_params.endpoints must list one [host, port] per producer TP rank "
                f"(tp_size={p_tp}), got {endpoints!r:.80}")
    try:
        plan_head_reads(p_tp, my_tp, as_int(theirs.get("num_kv_heads", 0)))
    except (TypeError, ValueError) as e:
        return f"re-sharding from producer tp_size={p_tp} to consumer tp_size={my_tp}: {e}"
    return ""


def linear_state_error(request: Request, p: Mapping[str, object]) -> str:
    """Why this decode engine of a model with a linear-attention state group cannot take the
    request's remote prefill, or "". Such a model resumes after all n prompt tokens with P's
    sampled token as its first output token (docs/ARCHITECTURE.md, "Where D's first token comes
    from"), so the params must carry that token ("first_token", an int), and logprobs are
    refused: P's params carry the token only, not its logprobs."""
    token = p.get("first_token")
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        return ("kv_transfer_params.first_token (P's sampled first output token) must be a "
                f"non-negative integer on a model with linear-attention state, got {token!r:.40}")
    if request.sampling_params.logprobs is not None:
        return ("logprobs are not supported for P/D on a model with linear-attention state: the "
                "first output token is sampled on P and its logprobs are not handed over; "
                "run the request colocated or without logprobs")
    return ""
