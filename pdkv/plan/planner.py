"""Assemble a plan: every figure with its unit and the assumption it rests on (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdkv.modelspec.dtypes import ElementType, element_type
from pdkv.modelspec.groups import (
    MLA,
    CompressedKV,
    CompressorState,
    FullAttention,
    IndexerKeys,
    LinearState,
    SharedKVWindow,
    SlidingWindow,
    StateGroup,
    per_token_bytes,
)
from pdkv.modelspec.hf_config import ModelSpec
from pdkv.plan import afd, capacity, costs
from pdkv.plan.links import Link
from pdkv.plan.pcp import (
    PcpModel,
    PcpShape,
    allgather_bytes,
    calibrate_flops,
    rank_work,
    split_threshold,
)

Value = float | int | str | None


@dataclass(frozen=True)
class Figure:
    """One printed number: `value` in `unit` (B, s, tokens, ratio, ...), and why."""

    key: str
    section: str
    label: str
    value: Value
    unit: str
    assumption: str


@dataclass(frozen=True)
class PlanInputs:
    """Everything `make_plan` reads. Give `model` or `kv_bytes` (bytes one link carries)."""

    link: Link
    model: ModelSpec | None = None
    model_source: str = ""
    kv_bytes: float | None = None
    prompt_len: int | None = None
    output_len: int = 128
    kv_dtype: str = "auto"
    tp: int = 1
    dcp: int = 1
    fixed: costs.FixedCosts = costs.FixedCosts()
    prefill_tps: float | None = None
    decode_tps: float | None = None
    target_ttft: float | None = None
    target_tpot: float | None = None
    act_dtype: str = "auto"
    block_size: int = 16
    pcp: int = 1
    pcp_shape: PcpShape | None = None
    pcp_link: Link | None = None
    pcp_shared_speedup: float | None = None
    pcp_overhead: float = 0.0
    contexts: tuple[int, ...] = ()


_LABELS: dict[type, str] = {
    FullAttention: "full attention", SlidingWindow: "sliding window", MLA: "MLA latent",
    SharedKVWindow: "sliding window (K = V)",
}


def _label(g: StateGroup) -> str:
    """The printed name of a token-sized group."""
    if isinstance(g, IndexerKeys):
        return f"indexer keys (CSA, 1 entry / {g.rate} tokens)"
    if isinstance(g, CompressedKV):
        short = "CSA" if g.layer_type == "compressed_sparse_attention" else "HCA"
        return f"compressed {short} (1 entry / {g.rate} tokens)"
    return _LABELS[type(g)]


def _fixed(g: StateGroup) -> bool:
    """A per-request group of fixed size (no bytes per token)."""
    return isinstance(g, (LinearState, CompressorState))


def check_parallel(model: ModelSpec | None, tp: int, dcp: int) -> None:
    """Validate tp/dcp as vLLM does (ANCHORS §3.1, §3.5).

    Raises:
        ValueError: tp or dcp < 1; tp % dcp != 0 (DCP reuses the TP ranks); dcp larger than the
            KV-head replication tp / kv_heads (GQA) or than tp (MLA).
    """
    if tp < 1 or dcp < 1:
        raise ValueError("tp and dcp must be >= 1")
    if tp % dcp:
        raise ValueError(f"dcp={dcp} must divide tp={tp} (DCP splits a TP group)")
    if model is not None and dcp > 1 and model.num_kv_heads:
        limit = max(1, tp // model.num_kv_heads)
        if dcp > limit:
            raise ValueError(
                f"dcp={dcp} exceeds tp/kv_heads = {tp}/{model.num_kv_heads} = {limit}: DCP shards "
                "tokens over the ranks that would otherwise hold replicated KV heads")


def _kv_type(inp: PlanInputs) -> tuple[ElementType, ElementType]:
    model_dt = element_type(inp.model.dtype) if inp.model else element_type("bf16")
    kv = model_dt if inp.kv_dtype == "auto" else element_type(inp.kv_dtype)
    return kv, model_dt


def make_plan(inp: PlanInputs) -> list[Figure]:
    """All figures for `inp`, in print order.

    Raises:
        ValueError: neither model nor kv_bytes, invalid tp/dcp, or bad numbers.
    """
    if inp.model is None and inp.kv_bytes is None:
        raise ValueError("give --model or --kv-bytes")
    check_parallel(inp.model, inp.tp, inp.dcp)
    check_pcp(inp)
    figs: list[Figure] = []
    add = figs.append
    T = inp.prompt_len
    L = inp.model.num_layers if inp.model else 1
    bs = inp.block_size
    if bs < 1:
        raise ValueError(f"block_size must be >= 1, got {bs}")
    link = inp.link

    # --- state size -------------------------------------------------------------------------
    if inp.model is not None:
        m = inp.model
        kv, st = _kv_type(inp)
        dtype_note = f"KV dtype {kv.name}" + (
            " (the config's dtype)" if inp.kv_dtype == "auto" else "")
        for g in m.groups:
            if isinstance(g, LinearState):
                add(
                    Figure(
                        f"state_bytes_per_request.{g.kind}",
                        "state",
                        f"{g.variant} state per request",
                        g.request_bytes(st, 1),
                        "B",
                        g.formula(st, 1)
                        + f"; state dtype {st.name} (the model's), not token-sharded",
                    )
                )
            elif isinstance(g, CompressorState):
                add(Figure(f"state_bytes_per_request.{g.kind}", "state",
                           f"{g.what} state per request", g.request_bytes(st, 1), "B",
                           g.formula(st, 1) + "; fixed size, not token-sharded"))
            else:
                per_entry = (f" = {g.token_bytes(kv, 1)} B per entry / {g.entry_tokens}"
                             if g.entry_tokens > 1 else "")
                add(Figure(f"bytes_per_token.{g.kind}", "state", f"{_label(g)} KV per token",
                           per_token_bytes(g, kv, 1), "B",
                           f"{g.formula(kv, 1)}{per_entry}; {dtype_note}"))
        per_token = sum(per_token_bytes(g, kv, 1) for g in m.groups)
        add(Figure("bytes_per_token", "state", "KV per token, all groups", per_token, "B",
                   "sum of the token-sized groups, whole model (tp=1)"))
        fixed = [g for g in m.groups if isinstance(g, CompressorState)]
        if fixed:
            add(Figure("state_bytes_per_request", "state", "fixed state per request, all groups",
                       sum(g.request_bytes(st, 1) for g in fixed), "B",
                       "sum of the per-request groups, whole model (tp=1)"))
        rank_tok = sum(per_token_bytes(g, kv, inp.tp) for g in m.groups)
        rank_req = sum(g.request_bytes(st, inp.tp) for g in m.groups)
        b_eff = rank_tok / inp.dcp
        moved: float | None = None
        if T:
            total_bytes = sum(g.token_bytes(kv, 1) * g.tokens_held(T) for g in m.groups) + sum(
                g.request_bytes(st, 1) for g in m.groups)
            add(Figure("request_bytes", "state", f"KV of a {T}-token prompt, whole model",
                       total_bytes, "B", "bytes per token × tokens held + per-request state, tp=1"))
            block_bytes = sum(
                g.token_bytes(kv, 1) * g.block_tokens_held(T, bs) for g in m.groups
            ) + sum(g.request_bytes(st, 1) for g in m.groups)
            window_note = (" (a window group: the blocks of its window)"
                           if any(isinstance(g, SlidingWindow) for g in m.groups) else "")
            if any(isinstance(g, CompressedKV) for g in m.groups):
                window_note += (f" (a compressed group: a block of {bs} tokens holds the "
                                f"entries of the windows ending in it, at least one slot)")
            add(
                Figure(
                    "request_block_bytes",
                    "state",
                    f"the same in whole blocks of {bs} tokens",
                    block_bytes,
                    "B",
                    f"ceil({T} / {bs}) blocks per group{window_note}: the KV cache "
                    "and P/D move whole blocks (--block-size)",
                )
            )
        add(Figure("rank_bytes_per_token", "rank", "KV per token on one rank", rank_tok, "B",
                   "; ".join(g.formula(kv, inp.tp) for g in m.groups if not _fixed(g))))
        if rank_req:
            how = ("V4 compressor state replicated" if any(
                isinstance(g, CompressorState) for g in m.groups) else "split over heads")
            add(Figure("rank_state_bytes", "rank", "state per request on one rank", rank_req, "B",
                       f"tp={inp.tp}: {how}; the same on every DCP rank"))
        if T:
            rank_tokens = math.ceil(T / inp.dcp)
            held = sum(g.token_bytes(kv, inp.tp) * g.tokens_held(rank_tokens) for g in m.groups)
            exact = held + rank_req
            moved = sum(g.token_bytes(kv, inp.tp) * g.block_tokens_held(rank_tokens, bs)
                        for g in m.groups) + rank_req
            add(Figure("rank_tokens", "rank", "tokens on one rank", rank_tokens, "tokens",
                       f"ceil({T} / dcp={inp.dcp}); DCP puts token t on rank (t // I) % dcp"))
            terms = [
                f"{g.token_bytes(kv, inp.tp)} B × {g.tokens_held(rank_tokens)} "
                f"{'entries' if g.entry_tokens > 1 else 'tokens'} ({g.kind})"
                for g in m.groups
                if not _fixed(g)
            ]
            add(Figure("rank_bytes", "rank", "KV of the prompt on one rank", exact, "B",
                       " + ".join(terms) + (f" + {rank_req} B state" if rank_req else "")
                       + f"; tp={inp.tp}, dcp={inp.dcp}"))
            add(
                Figure(
                    "rank_block_bytes",
                    "rank",
                    f"the same in whole blocks of {bs} tokens (what moves)",
                    moved,
                    "B",
                    f"ceil({rank_tokens} / {bs}) blocks per group: P/D moves whole blocks",
                )
            )
            add(
                Figure(
                    "cluster_bytes",
                    "rank",
                    f"KV moved by the {inp.tp} rank(s) of one instance",
                    moved * inp.tp,
                    "B",
                    "ranks × per-rank bytes in whole blocks: each D rank pulls its own shard or "
                    "replica",
                )
            )
    else:
        moved = inp.kv_bytes
        rank_req = 0
        b_eff = (inp.kv_bytes / T) if (inp.kv_bytes is not None and T) else 0.0

    # --- state at context lengths -----------------------------------------------------------
    if inp.contexts:
        if inp.model is None:
            raise ValueError("--context needs --model (its state groups), not --kv-bytes")
        figs += context_figures(inp)

    # --- handoff ----------------------------------------------------------------------------
    add(Figure("link_bandwidth", "handoff", f"link {link.name}", link.bandwidth, "B/s", link.note))
    if moved is not None:
        prefill_s = T / inp.prefill_tps if (T and inp.prefill_tps) else None
        h = costs.handoff(moved, link, inp.fixed)
        scope = (
            "one rank's whole blocks over its own link; ranks move in parallel"
            if inp.model
            else "--kv-bytes over one link"
        )
        add(Figure("handoff_bytes", "handoff", "bytes per link", moved, "B", scope))
        add(Figure("wire_s", "handoff", "wire time", h.wire, "s",
                   f"{moved:.4g} B / {link.bandwidth:.4g} B/s"))
        add(Figure("handshake_s", "handoff", "handshake", inp.fixed.handshake(link), "s",
                   f"{inp.fixed.handshake_rtts:g} round trip × 2 × {link.latency:g} s latency"))
        add(Figure("scheduling_s", "handoff", "scheduling", inp.fixed.scheduling, "s",
                   "D starts the pull on one scheduler step and sees it finished on another "
                   "(assumed; --sched-overhead)"))
        add(Figure("layout_s", "handoff", "layout conversion", inp.fixed.layout, "s",
                   "0: P and D share tp, block size and dtype (--layout-overhead otherwise)"))
        add(
            Figure(
                "handoff_s",
                "handoff",
                "handoff time",
                h.total,
                "s",
                "wire + handshake + scheduling + layout, all after the prefill: KV published once "
                "the prefill ends, as pull mode (the default) does",
            )
        )
        if prefill_s is not None:
            hl = costs.handoff(moved, link, inp.fixed, L, prefill_s)
            add(Figure("prefill_s", "handoff", "prefill compute", prefill_s, "s",
                       f"{T} tokens / {inp.prefill_tps:g} tok/s (--prefill-tps)"))
            add(
                Figure(
                    "overlap_hidden_s",
                    "handoff",
                    "layer-wise push (transfer_mode push): hidden",
                    hl.hidden,
                    "s",
                    f"(L−1)/L · min(wire, prefill) with L={L} layers: the wire time a "
                    "layer-wise push (docs/PUSH.md) overlaps with the prefill",
                )
            )
            add(
                Figure(
                    "handoff_layerwise_s",
                    "handoff",
                    "layer-wise push (transfer_mode push): handoff",
                    hl.total,
                    "s",
                    "handoff time − hidden: what remains after the prefill",
                )
            )
            add(Figure("handoff_share_of_ttft", "handoff", "handoff / (prefill + handoff)",
                        h.total / (prefill_s + h.total), "ratio",
                        "share of an unloaded P/D TTFT spent moving KV (no queueing, no overlap)"))

    # --- recompute vs reload ----------------------------------------------------------------
    if inp.prefill_tps and b_eff:
        n_star = costs.breakeven_tokens(b_eff, rank_req, inp.prefill_tps, link, inp.fixed)
        why = (
            f"n* = (F + S/W) / (1/P − b/W): F={inp.fixed.total(link):.3g} s fixed, "
            f"S={rank_req} B state, b={b_eff:.6g} B/token per link, W={link.bandwidth:.4g} B/s, "
            f"P={inp.prefill_tps:g} tok/s; recompute taken as linear in n (no n² attention term)"
        )
        add(
            Figure(
                "breakeven_tokens",
                "reload",
                "reload beats recompute above",
                None if n_star is None else math.ceil(n_star),
                "tokens",
                why
                if n_star is not None
                else f"never: loading a token ({b_eff:.4g} B / {link.bandwidth:.4g} B/s) is "
                f"slower than computing it (1/{inp.prefill_tps:g} s)",
            )
        )
        if T:
            hr = costs.pool_breakeven_hit_rate(T, b_eff, rank_req, inp.prefill_tps, link, inp.fixed)
            note = (
                (
                    "h* = (F + S/W) / (n · (1/P − b/W)) for the prompt length n; above 1: a pool "
                    "does not pay at this length"
                )
                if hr is not None
                else "no hit rate pays on this link"
            )
            add(
                Figure(
                    "pool_breakeven_hit_rate",
                    "reload",
                    f"pool pays above this hit rate (n={T})",
                    hr,
                    "ratio",
                    note,
                )
            )

    # --- prefill context parallelism --------------------------------------------------------
    if inp.pcp > 1:
        figs += pcp_figures(inp)

    # --- P:D ratio --------------------------------------------------------------------------
    if T and inp.prefill_tps and inp.decode_tps:
        hs = costs.handoff(moved or 0.0, link, inp.fixed).total
        r = capacity.pd_ratio(T, inp.output_len, inp.prefill_tps, inp.decode_tps, hs,
                              inp.target_ttft, inp.target_tpot)
        ttft = (
            f"target TTFT {inp.target_ttft:g} s → P utilisation ρ = 2B/(s+2B), B = TTFT − s − "
            f"handoff (M/D/1 mean wait)"
            if inp.target_ttft is not None
            else "no TTFT target: ρ = 1"
        )
        add(Figure("pd_ratio", "pd", "prefill instances per decode instance", r.p_per_d, "ratio",
                   f"P:D = (D/n_out) / (ρ·P/n_in), n_in={T}, n_out={inp.output_len}, "
                   f"P={inp.prefill_tps:g}, D={inp.decode_tps:g} tok/s; {ttft}"
                   + (f"; rounded {r.rounded()}" if r.p_per_d is not None else
                      "; TTFT target below prefill + handoff: no ratio meets it")))
        if r.utilisation is not None:
            add(Figure("prefill_utilisation", "pd", "prefill utilisation allowed", r.utilisation,
                       "ratio", "the load at which the mean queue wait fits the TTFT budget"))
        if r.d_streams is not None:
            add(Figure("decode_streams", "pd", "streams per decode instance at target TPOT",
                       r.d_streams, "streams",
                       f"D · TPOT = {inp.decode_tps:g} tok/s × {inp.target_tpot:g} s; holds if D "
                       "was measured at a batch at least this large"))

    # --- attention-FFN disaggregation (paper estimate) ---------------------------------------
    if inp.model is not None:
        act = (
            element_type(inp.model.dtype)
            if inp.act_dtype == "auto"
            else element_type(inp.act_dtype)
        )
        why_act = "the model's dtype" if inp.act_dtype == "auto" else "--act-dtype"
        tokens = T or 1
        t = afd.activation_traffic(inp.model.hidden_size, tokens, L, act.bytes,
                                   inp.model.experts_per_token)
        base = (f"hidden {inp.model.hidden_size} · {tokens} tokens · {act.bytes} B "
                f"({act.name}, {why_act})")
        add(Figure("afd_layer_direction", "afd", "per layer, per direction", t.per_layer_direction,
                   "B", base + "; paper estimate, not a pdkv feature"))
        add(Figure("afd_layer_both", "afd", "per layer, both directions", t.per_layer_both, "B",
                   "2 · " + base))
        add(Figure("afd_model_both", "afd", f"all {L} layers, both directions", t.model_both, "B",
                   f"2 · {L} layers · " + base))
        if inp.model.experts_per_token > 1:
            add(
                Figure(
                    "afd_moe_dispatch",
                    "afd",
                    "per layer to FFN, MoE dispatch upper bound",
                    t.moe_dispatch_upper,
                    "B",
                    f"× top-k {inp.model.experts_per_token} when every chosen expert is on another "
                    "node",
                )
            )
    return figs


def context_figures(inp: PlanInputs) -> list[Figure]:
    """Per group and in total, the state one request holds at each of inp.contexts tokens (whole
    model, tp=1, exact entries: no block rounding), and the handoff of that state over inp.link
    as one transfer after the prefill (wire + handshake + scheduling + layout).

    Raises:
        ValueError: a context length < 0.
    """
    assert inp.model is not None
    kv, st = _kv_type(inp)
    figs: list[Figure] = []
    add = figs.append
    for n in inp.contexts:
        if n < 0:
            raise ValueError(f"context lengths must be >= 0, got {n}")
        total = 0
        for g in inp.model.groups:
            if _fixed(g):
                b = g.request_bytes(st, 1)
                why = "fixed per request, any length"
            else:
                held = g.tokens_held(n)
                b = g.token_bytes(kv, 1) * held
                unit = "entries" if g.entry_tokens > 1 else "tokens"
                why = f"{g.token_bytes(kv, 1)} B × {held:,} {unit} held ({kv.name})"
            total += b
            add(Figure(f"context_bytes.{n}.{g.kind}", "context", f"{n:,} tokens: {g.kind}", b,
                       "B", why))
        add(Figure(f"context_bytes.{n}", "context", f"{n:,} tokens: all groups", total, "B",
                   "sum over the groups, whole model, tp=1, exact (not in whole blocks)"))
        h = costs.handoff(total, inp.link, inp.fixed)
        add(Figure(f"context_handoff_s.{n}", "context",
                   f"{n:,} tokens: handoff over {inp.link.name}", h.total, "s",
                   f"{total:.4g} B / {inp.link.bandwidth:.4g} B/s = {h.wire:.4g} s wire + "
                   f"{h.fixed:.3g} s fixed (handshake, scheduling, layout), one link, after the "
                   "prefill"))
    return figs


def check_pcp(inp: PlanInputs) -> None:
    """Refuse PCP terms the plan (or pdkv) cannot give.

    Raises:
        ValueError: pcp < 1; pcp > 1 with tp or dcp > 1 (not built in pdkv yet), without a model
            (--kv-bytes), with a group other than full attention (pdkv refuses those models at
            start-up), without --prompt-len or the model's dimensions; a shared speed-up <= 0.
    """
    if inp.pcp < 1:
        raise ValueError(f"pcp must be >= 1, got {inp.pcp}")
    if inp.pcp == 1:
        return
    if inp.tp > 1 or inp.dcp > 1:
        raise ValueError(
            f"pcp={inp.pcp} with tp={inp.tp}, dcp={inp.dcp}: PCP with TP or DCP is not built yet "
            "(issue 32); the plan gives PCP's terms at tp 1, dcp 1")
    if inp.model is None or inp.pcp_shape is None:
        raise ValueError("PCP terms need --model (its layers, heads and widths), not --kv-bytes")
    other = [g.kind for g in inp.model.groups if type(g) is not FullAttention]
    if other:
        raise ValueError(
            f"PCP is built for full-attention models only; {inp.model.name} has "
            f"{', '.join(other)} (pdkv refuses it at start-up)")
    if not inp.prompt_len:
        raise ValueError("PCP terms are for one prompt: give --prompt-len")
    if inp.pcp_shared_speedup is not None and inp.pcp_shared_speedup <= 0:
        raise ValueError(f"--pcp-shared-speedup must be > 0, got {inp.pcp_shared_speedup}")
    if inp.pcp_overhead < 0:
        raise ValueError(f"--pcp-overhead must be >= 0, got {inp.pcp_overhead}")


def pcp_figures(inp: PlanInputs) -> list[Figure]:
    """PCP's figures for a prefill of inp.prompt_len tokens on inp.pcp ranks (formulas:
    pdkv.plan.pcp); time terms only with --prefill-tps (it calibrates the FLOP/s)."""
    shape, n, plen = inp.pcp_shape, inp.pcp, inp.prompt_len
    assert shape is not None and plen and inp.model is not None  # check_pcp
    kv, model_dt = _kv_type(inp)
    act = model_dt if inp.act_dtype == "auto" else element_type(inp.act_dtype)
    link = inp.pcp_link or inp.link
    s_shared = inp.pcp_shared_speedup or 1.0
    figs: list[Figure] = []
    add = figs.append
    work = rank_work(shape, plen, n)
    single = rank_work(shape, plen, 1)[0]
    top = max(work, key=lambda w: w.flops)
    split = plen >= split_threshold(n)
    chunks = (f"2N={2 * n} chunks of ceil({plen}/{2 * n}) tokens, rank r computes chunks r and "
              f"{2 * n - 1}−r (head-tail)" if split else
              f"not split: {plen} < 2N × 16 = {split_threshold(n)}; every rank runs the whole "
              "prompt")
    add(Figure("pcp_rank_tokens", "pcp", "tokens the fullest rank computes", top.rows, "tokens",
               chunks))
    w = shape.layer_weights
    add(Figure("pcp_single_flops", "pcp", "prefill FLOPs on one rank", single.flops, "FLOP",
               f"linear {shape.num_layers} layers × {plen} tokens × 2 × {w:,} weights/layer "
               f"(q k v o gate up down) + attention {shape.num_layers} × {single.key_pairs:,} "
               f"causal pairs × 4 × {shape.num_heads} heads × {shape.head_dim} + lm head 2 × "
               f"{shape.hidden_size} × {shape.vocab_size} (one sampled row)"))
    add(Figure("pcp_rank_flops", "pcp", "prefill FLOPs on the busiest rank", top.flops, "FLOP",
               f"the same on {top.rows} tokens with {top.key_pairs:,} causal pairs (each query "
               "attends over the whole prefix in its replica); the lm head on every rank"))
    add(Figure("pcp_compute_share", "pcp", "busiest rank / one rank", top.flops / single.flops,
               "ratio", f"1/N = {1 / n:.3g} would be a perfect split"))
    nbytes = allgather_bytes(shape, plen, n, kv.bytes, act.bytes)
    add(Figure("pcp_comm_bytes", "pcp", "all-gather bytes one rank receives", nbytes, "B",
               f"{shape.num_layers} layers × {top.rows} rows × 2 (K, V) × {shape.num_kv_heads} kv "
               f"heads × {shape.head_dim} × {kv.bytes} B ({kv.name}) × (N−1) + the sampled row "
               f"{shape.hidden_size} × {act.bytes} B × (N−1); 0 when not split"
               if split else "0: the prompt is not split"))
    add(Figure("pcp_link_bandwidth", "pcp", f"PCP all-gather link {link.name}", link.bandwidth,
               "B/s", link.note + " (--pcp-link / --pcp-bandwidth / --pcp-latency)"))
    rank_note = (f"ranks share one box's cores: each runs at F / {s_shared:g} "
                 "(--pcp-shared-speedup)" if inp.pcp_shared_speedup else
                 "each rank on its own device, at F (no --pcp-shared-speedup)")
    if not inp.prefill_tps:
        add(Figure("pcp_prefill_s", "pcp", f"prefill on {n} ranks", None, "s",
                   "n/a: give --prefill-tps (one rank's measured prefill tok/s at --prompt-len) "
                   "to calibrate the FLOP/s"))
        return figs
    t0 = inp.pcp_overhead
    flops = calibrate_flops(shape, plen, plen / inp.prefill_tps, t0)
    model = PcpModel(shape, n, flops, link.bandwidth, link.latency, kv.bytes, act.bytes, s_shared,
                     t0)
    c = model.cost(plen)
    add(Figure("pcp_flops_per_s", "pcp", "achieved FLOP/s of one rank", flops, "FLOP/s",
               f"F = {single.flops:.4g} FLOP / ({plen} tokens / {inp.prefill_tps:g} tok/s − "
               f"{t0:g} s overhead); "
               + ("every second of the measured prefill charged to FLOPs (no --pcp-overhead)"
                  if not t0 else "--pcp-overhead: the part splitting does not shorten")))
    add(Figure("pcp_single_s", "pcp", "prefill on one rank", c.single_s, "s",
               f"{plen} tokens / {inp.prefill_tps:g} tok/s (--prefill-tps)"))
    add(Figure("pcp_compute_s", "pcp", f"compute on the busiest of {n} ranks", c.compute_s, "s",
               f"{top.flops:.4g} FLOP / (F / {s_shared:g}); {rank_note}"))
    add(Figure("pcp_comm_s", "pcp", "all-gathers", c.comm_s, "s",
               f"({shape.num_layers} + 1) all-gathers × (N−1) × {link.latency:g} s + "
               f"{c.comm_bytes:.4g} B / {link.bandwidth:.4g} B/s (ring all-gather; no overlap "
               "with compute)" if split else "0: not split"))
    add(Figure("pcp_prefill_s", "pcp", f"prefill on {n} ranks", c.pcp_s, "s",
               f"{t0:g} s overhead (--pcp-overhead) + compute + all-gathers"))
    add(Figure("pcp_speedup", "pcp", "one rank / PCP", c.speedup, "ratio",
               "> 1: PCP prefills this prompt faster"))
    cross = model.crossover()
    add(Figure("pcp_crossover_tokens", "pcp", f"PCP {n} beats one rank from", cross, "tokens",
               f"smallest prompt with PCP prefill < one rank's, F held at the calibrated value; "
               f"{rank_note}" + ("" if cross is not None else
                                 "; never up to 16 M tokens: the split saves less compute "
                                 "than the all-gathers cost")))
    return figs

