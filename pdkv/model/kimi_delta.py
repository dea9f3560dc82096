"""Kimi Delta Attention (KDA) in plain torch: the gated delta rule with a per-channel decay,
recurrent (one token at a time) and chunked (chunks of 64 tokens), both starting from and
returning a recurrent state. The causal short conv is pdkv.model.gated_delta's.

Numerics follow HF transformers' Kimi-Linear (modeling_kimi_linear.py:
`recurrent_kimi_delta_attention`, `chunk_kimi_delta_attention`, l2norm as x / sqrt(sum(x^2) +
1e-6), q scaled by dk ** -0.5, all in float32). Per head, with state S [dk, dv], decay g_t [dk]
<= 0 (log space, one value per key channel, where Gated DeltaNet has one per head) and write
strength beta_t in (0, 1):

    S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t (v_t - k_t^T diag(exp(g_t)) S_{t-1}))^T,
    o_t = S_t^T q_t.

The chunked form (the UT transform, as FLA's chunk_kda) computes the same within rounding;
`kda_rule` picks it for prefills and the recurrent form for decodes, as HF's model does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (HF's default)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (HF Kimi-Linear's form)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B requests through the rule, batched.

    Args:
        q, k, g: [B, H, dk]; v: [B, H, dv]; beta: [B, H]; state: [B, H, dk, dv].

    Returns:
        (out [B, H, dv] float32, new states [B, H, dk, dv] float32).
    """
    q, k = _prepare(q, k)
    s = state.float() * g.float().exp()[..., None]
    kv_mem = (s * k[..., None]).sum(dim=-2)
    delta = (v.float() - kv_mem) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(dim=-2), s


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule one token at a time.

    Args:
        q, k, g: [n, H, dk]; v: [n, H, dv]; beta: [n, H]; state: [H, dk, dv] float32.

    Returns:
        (out [n, H, dv] float32, state after the last token).
    """
    s = state.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[0]):
        o, s1 = kda_step(q[t, None], k[t, None], v[t, None], g[t, None], beta[t, None], s[None])
        out[t], s = o[0], s1[0]
    return out, s


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in chunks of `chunk` tokens (same arguments and results as `recurrent_kda`):
    within a chunk the updates are solved at once (a unit lower-triangular system whose entries
    carry the per-channel decay between the two tokens), across chunks the state is carried.
    Decays are taken as exp(cum_i - cum_j) per channel, never exp(-cum), so long chunks of
    strong decay do not overflow."""
    n = v.shape[0]
    q, k = _prepare(q, k)
    q, k, v, g = (x.transpose(0, 1).float() for x in (q, k, v, g))  # [H, n, d]
    beta = beta.t().float()
    pad = (chunk - n % chunk) % chunk
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    h = v.shape[0]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, g, k_beta, v_beta = (
        x.reshape(h, -1, chunk, x.shape[-1]) for x in (q, k, g, k_beta, v_beta)
    )
    cum = g.cumsum(dim=-2)  # [h, chunks, chunk, dk]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (
        (cum[..., :, None, :] - cum[..., None, :, :])
        .masked_fill(upper[..., None], float("-inf"))
        .exp()
    )
    system = torch.einsum("hcid,hcjd,hcijd->hcij", k_beta, k, decay)
    intra = torch.einsum("hcid,hcjd,hcijd->hcij", q, k, decay)
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(
        system, k_beta * cum.exp(), upper=False, unitriangular=True
    )
    q = q * cum.exp()
    last = cum[..., -1:, :]  # [h, chunks, 1, dk]
    k = k * (last - cum).exp()
    s = state.float()
    out = torch.empty_like(new_v)
    for i in range(new_v.shape[1]):
        v_new = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * last[:, i, 0, :, None].exp() + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, -1, out.shape[-1])[:, :n].transpose(0, 1), s


def kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form for one token (decode), the chunked form for more (prefill), as HF."""
    if v.shape[0] == 1:
        return recurrent_kda(q, k, v, g, beta, state)
    return chunk_kda(q, k, v, g, beta, state)
