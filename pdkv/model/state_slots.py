"""Driving a linear-attention layer over its state slots (shared by Gated DeltaNet and KDA).

A linear layer's state for one request lives in one slot of the linear-state group's tensor
(pdkv.worker.kv_cache): per slot and layer `conv_bytes` of conv window [conv_dim, K - 1] in the
model dtype, then the recurrent state (`rec_shape`) in float32. Per step, each request reads its
source slot (zero state when fresh) and writes the state after each of its segments (split at
block ends: prefix-cache checkpoints) to that segment's slot (pdkv.model.gated_delta
`LinearStateMetadata`). Runs of consecutive decodes (one token from an existing state) go as one
batch; requests keep their batch order (a checkpoint written earlier in a step is read after).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdkv.model.gated_delta import LinearStateMetadata, causal_conv, causal_conv_step, decode_runs

Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(q, k, v, g, beta, state) -> (out [T, Hv, dv] float32, new state): a chunk or one-step rule."""


class StateSlotMixin:
    """Slot bookkeeping of a linear layer. The layer sets `dtype`, `conv_dim`, `kernel`,
    `conv_bytes`, `rec_shape` (recurrent state per slot), `conv` (the depthwise conv weight
    [conv_dim, K]) and the rules `chunk_rule` / `step_rule`, and implements `split_qkv`."""

    dtype: torch.dtype
    conv_dim: int
    kernel: int
    conv_bytes: int
    rec_shape: tuple[int, ...]
    conv: torch.Tensor
    chunk_rule: Rule
    step_rule: Rule

    def split_qkv(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [T, conv_dim] -> q, k, v per head."""
        raise NotImplementedError

    def state_views(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's [slots, bytes] uint8 state -> (conv [slots, conv_dim, K - 1] in the model
        dtype, recurrent [slots, *rec_shape] float32), views into it."""
        s = state.shape[0]
        conv = state[:, : self.conv_bytes].view(self.dtype).view(s, self.conv_dim, self.kernel - 1)
        rec = state[:, self.conv_bytes :].view(torch.float32).view(s, *self.rec_shape)
        return conv, rec

    def run_state(
        self,
        meta: LinearStateMetadata,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Every request of the step: conv over `mixed` [T, conv_dim], then the rule with decay
        `g` and `beta`, into `out` [T, Hv, dv] (float32), reading and writing `state`."""
        conv_state, rec_state = self.state_views(state)
        batches = meta.decode_batches
        if batches is None:
            batches = decode_runs(meta.requests, mixed.device)
        run = 0
        pending = False  # a run of decodes waits to go as one batch
        for start, n, src, segments in meta.requests:
            if n == 1 and src >= 0:
                pending = True
                continue
            if pending:
                self._decode_batch(batches[run], mixed, g, beta, conv_state, rec_state, out)
                run, pending = run + 1, False
            self._run_request(start, src, segments, mixed, g, beta, conv_state, rec_state, out)
        if pending:
            self._decode_batch(batches[run], mixed, g, beta, conv_state, rec_state, out)

    def _run_request(
        self,
        start: int,
        src: int,
        segments: tuple[tuple[int, int], ...],
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_state: torch.Tensor,
        rec_state: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """One request's tokens from its source state (zero when src < 0), segment by segment,
        each segment's final state written to its slot."""
        if src < 0:
            conv, rec = torch.zeros_like(conv_state[0]), torch.zeros_like(rec_state[0])
        else:
            conv, rec = conv_state[src], rec_state[src]
        at = start
        for length, dst in segments:
            rows = slice(at, at + length)
            c, conv = causal_conv(mixed[rows], conv, self.conv)
            q, k, v = self.split_qkv(c)
            out[rows], rec = self.chunk_rule(q, k, v, g[rows], beta[rows], rec)
            conv_state[dst], rec_state[dst] = conv, rec
            at += length

    def _decode_batch(
        self,
        batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_state: torch.Tensor,
        rec_state: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """One token each of a run of decodes, batched: (flat rows, source slots, destination
        slots) long tensors (LinearStateMetadata.decode_batches)."""
        rows, src, dst = batch
        c, conv = causal_conv_step(mixed[rows], conv_state[src], self.conv)
        q, k, v = self.split_qkv(c)
        out[rows], rec = self.step_rule(q, k, v, g[rows], beta[rows], rec_state[src])
        conv_state[dst], rec_state[dst] = conv.to(conv_state.dtype), rec
