"""Gated DeltaNet token mixing in plain torch: the causal depthwise conv with a carried window and
the gated delta rule, recurrent (one token at a time) and chunked (chunks of 64 tokens), both
starting from and returning a recurrent state.

Numerics follow HF transformers' Qwen3-Next (modeling_qwen3_next.py: `causal_conv1d_fn` /
`causal_conv1d_update`, `torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule`,
l2-normalised q and k, q scaled by dk ** -0.5, all in float32). The delta rule per value head,
with state S [dk, dv], decay g_t <= 0 (log space) and write strength beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,    o_t = S_t^T q_t.

The chunked form (the WY / UT transform of the DeltaNet paper, Yang et al. 2024) computes the same
within rounding; `gated_delta_rule` picks it for prefills and the recurrent form for decodes, as
HF's model does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (HF's default)


@dataclass(frozen=True)
class LinearStateMetadata:
    """The linear-state group's metadata of one step: per scheduled request, in flat-batch order,
    (flat start, query tokens n, source slot, segments). The request's state before its first
    token is read from the source slot (-1: a fresh request, zero state); its n tokens are then
    run as consecutive segments (length, destination slot), the state after each segment written
    to its slot (see pdkv.worker.attn_metadata.build_linear_state_metadata). Requests run in this
    order, so a checkpoint one request writes is visible to a later one in the same step.

    `decode_batches` holds, per run of consecutive decodes (n == 1 from an existing state), its
    (flat rows, source slots, destination slots) as long tensors on the model's device, built
    with the metadata (`decode_runs`) so the forward makes none from host lists; None: built by
    the layer when it runs (hand-made metadata in tests)."""

    requests: tuple[tuple[int, int, int, tuple[tuple[int, int], ...]], ...]
    decode_batches: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...] | None = None


def decode_runs(
    requests: tuple[tuple[int, int, int, tuple[tuple[int, int], ...]], ...], device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
    """(rows, source slots, destination slots) of each maximal run of consecutive decodes among
    LinearStateMetadata.requests, as long tensors on `device`, in order."""
    runs: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    for start, n, src, segments in requests:
        if n == 1 and src >= 0:
            cur.append((start, src, segments[0][1]))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    out = []
    for run in runs:
        rows, src_slots, dst_slots = (
            torch.tensor(col, dtype=torch.long, device=device) for col in zip(*run)
        )
        out.append((rows, src_slots, dst_slots))
    return tuple(out)


def causal_conv(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with SiLU over one request's new tokens, continuing from a window.

    Args:
        x: [n, C] the new tokens' channels.
        conv_state: [C, K - 1] the previous K - 1 inputs (zeros for a fresh request, which equals
            HF's left zero padding).
        weight: [C, K] per-channel kernel.

    Returns:
        (silu(conv) [n, C], the new window [C, K - 1]: the last K - 1 inputs).
    """
    n = x.shape[0]
    k = weight.shape[1]
    full = torch.cat((conv_state.to(x.dtype), x.t()), dim=1)  # [C, K - 1 + n]
    out = F.conv1d(full[None], weight[:, None, :], groups=weight.shape[0])[0, :, -n:]
    return F.silu(out).t(), full[:, full.shape[1] - (k - 1):]


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` for one new token of each of B requests at once: x [B, C], conv_state
    [B, C, K - 1]; returns (silu(conv) [B, C], new windows [B, C, K - 1])."""
    full = torch.cat((conv_state.to(x.dtype), x[:, :, None]), dim=2)  # [B, C, K]
    out = F.conv1d(full, weight[:, None, :], groups=weight.shape[0])[:, :, -1]
    return F.silu(out), full[:, :, 1:]


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B requests through the rule (the recurrent form's operations, batched).

    Args:
        q, k: [B, Hk, dk]; v: [B, Hv, dv]; g, beta: [B, Hv]; state: [B, Hv, dk, dv].

    Returns:
        (out [B, Hv, dv] float32, new states [B, Hv, dk, dv] float32).
    """
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = l2norm(q.float()), l2norm(k.float()), v.float()
    q = q * q.shape[-1] ** -0.5
    s = state.float() * g.float().exp()[..., None, None]
    kv_mem = (s * k[..., None]).sum(dim=-2)
    delta = (v - kv_mem) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(dim=-2), s


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (FLA's and HF's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:
    """[n, heads, d] inputs -> float32 [heads_v, n, d], q / k l2-normalised (q also scaled),
    key heads repeated for grouped value heads; g, beta -> [heads_v, n]."""
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.t().float(), beta.t().float()


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule one token at a time.

    Args:
        q, k: [n, Hk, dk]; v: [n, Hv, dv]; g, beta: [n, Hv] (Hk divides Hv).
        state: [Hv, dk, dv] float32, the state before the first token.

    Returns:
        (out [n, Hv, dv] float32, state after the last token).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        kv_mem = (s * k[:, t, :, None]).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        s = s + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (s * q[:, t, :, None]).sum(dim=-2)
    return out.transpose(0, 1), s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in chunks of `chunk` tokens (same arguments and results as the recurrent form):
    within a chunk the updates are solved at once (a unit lower-triangular system), across chunks
    the state is carried."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    n = v.shape[1]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    h = v.shape[0]
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(h, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(h, -1, chunk).cumsum(dim=-1)  # [h, chunks, chunk]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = state.float()
    out = torch.empty_like(new_v)
    for i in range(new_v.shape[1]):
        v_new = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, -1, out.shape[-1])[:, :n].transpose(0, 1), s


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form for one token (decode), the chunked form for more (prefill), as HF."""
    if v.shape[0] == 1:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state)
    return chunk_gated_delta_rule(q, k, v, g, beta, state)
