"""Torch-free parts of `pdkv bench groups`: the real-size state of hybrid model families from
their published configs (via `pdkv plan`'s model, pdkv/plan/), the block-granular bytes pdkv's
P2P connector moves per KV cache group, and the tables.

Formulas (docs/ARCHITECTURE.md "State groups"): for an n-token prompt in blocks of bs tokens, a
full-attention group moves ⌈n / bs⌉ blocks; a sliding-window group (window W) moves the blocks
from (B − W + 1) // bs on, B = ⌊(n − 1) / bs⌋·bs (the window of the token D resumes at and of a
later prefix hit of B tokens), so at most ⌈(W − 1) / bs⌉ + 1 blocks whatever n; a linear-state
group moves one state slot (the state after all n tokens) whatever n.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from pdkv.cache.specs import window_first_block
from pdkv.modelspec.dtypes import element_type
from pdkv.modelspec.groups import LinearState
from pdkv.modelspec.hf_config import spec_from_hf_config
from pdkv.plan.resolve import load_config


class GroupPlan(TypedDict):
    """One KV cache group of an engine: what D pulls of it for a prompt."""

    kind: str
    layers: int
    window: int | None
    blocks: int
    block_bytes: int
    bytes_per_token: int


class _PullRow(TypedDict):
    model: str
    prompt_tokens: int
    groups: list[GroupPlan]
    formula_bytes: int
    bytes_received: int
    transfer_s: float
    transfer_s_all: list[float]


class MeasuredRow(_PullRow, total=False):
    """One (model, prompt length) of `pdkv bench groups`; ratios set by `add_peer_ratios`."""

    bytes_ratio: float
    time_ratio: float


class RealSizeRow(TypedDict):
    """One state group of a published config (`pdkv plan`'s model): bytes held per prompt length
    (keys: the lengths as strings)."""

    model: str
    kind: str
    layers: int
    dtype: str
    bytes_per_token: int
    bytes_per_request: int
    held: dict[str, int]


class GroupsResult(TypedDict):
    """What `run_groups_bench` returns and `--json` writes."""

    rows: list[MeasuredRow]
    real_size: list[RealSizeRow]
    peer: str
    repeats: int
    transfer: str
    cpu_count: int | None
    prompt_lens: list[int]
    block_size: int


# Published configs bundled under pdkv/plan/configs/, one per family issue 11 names.
REAL_MODELS = ("gemma-3-27b", "deepseek-v3", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b")


def blocks_moved(
    num_tokens: int, block_size: int, window: int | None, per_request: bool = False,
    resume_at_end: bool = False,
) -> int:
    """Blocks of one group D pulls for an n-token prompt (no local hits): all ⌈n / bs⌉ for full
    attention (and MLA) and compressed entries, the window rule above for a sliding-window
    group, and one state slot for a state-slot group (`per_request`: the state after all n
    tokens, whatever n). `resume_at_end`: the model has a state-slot group, so D resumes at n
    (after P's token), not n - 1, and keeps the window of that position's block boundary.

    Raises:
        ValueError: num_tokens < 1 or block_size < 1.
    """
    if num_tokens < 1 or block_size < 1:
        raise ValueError(f"num_tokens ({num_tokens}) and block_size ({block_size}) must be >= 1")
    if per_request:
        return 1
    resume = num_tokens if resume_at_end else num_tokens - 1
    return -(-num_tokens // block_size) - window_first_block(resume, block_size, window)


def real_size_rows(models: Sequence[str] = REAL_MODELS, prompt_lens: Sequence[int] = (1024, 4096)
                   ) -> list[RealSizeRow]:
    """Per model and state group: kind, layers, bytes per token (0 for a per-request state),
    bytes per request (linear state) and bytes held for each prompt length, in the config's
    dtype at tp 1 (`pdkv plan`'s model).

    Raises:
        ValueError: an unknown model name.
    """
    rows: list[RealSizeRow] = []
    for name in models:
        cfg, _ = load_config(name)
        spec = spec_from_hf_config(cfg, name)
        dt = element_type(spec.dtype)
        for g in spec.groups:
            per_token = 0 if isinstance(g, LinearState) else g.token_bytes(dt)
            rows.append(
                {
                    "model": name,
                    "kind": g.kind,
                    "layers": g.num_layers,
                    "dtype": spec.dtype,
                    "bytes_per_token": per_token,
                    "bytes_per_request": g.request_bytes(dt),
                    "held": {
                        str(n): g.tokens_held(n) * per_token + g.request_bytes(dt)
                        for n in prompt_lens
                    },
                }
            )
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def format_real_size(rows: list[RealSizeRow], prompt_lens: Sequence[int]) -> str:
    """The real-size table: one line per (model, group) plus a total line per model (MiB)."""
    head = f"{'model':>20} {'group':>15} {'layers':>6} {'B/token':>9} {'B/request':>10}" + "".join(
        f" {f'MiB @{n}':>11}" for n in prompt_lens)
    lines = [head]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        for r in mine:
            lines.append(
                f"{model:>20} {r['kind']:>15} {r['layers']:>6} {r['bytes_per_token']:>9,} "
                f"{r['bytes_per_request']:>10,}"
                + "".join(f" {_mib(r['held'][str(n)]):>11}" for n in prompt_lens)
            )
        lines.append(
            f"{model:>20} {'total':>15} {sum(r['layers'] for r in mine):>6} "
            f"{sum(r['bytes_per_token'] for r in mine):>9,} "
            f"{sum(r['bytes_per_request'] for r in mine):>10,}"
            + "".join(f" {_mib(sum(r['held'][str(n)] for r in mine)):>11}" for n in prompt_lens)
        )
    return "\n".join(lines)


def format_measured(rows: list[MeasuredRow]) -> str:
    """The measured table: per (model, prompt length), each group's blocks and bytes by the
    formula, D's measured bytes (must equal their sum), handoff time and the ratios to the
    peer model's row of the same length."""
    head = (
        f"{'model':>15} {'prompt':>6} {'groups (kind: blocks x B/block)':>52} {'MiB formula':>11} "
        f"{'MiB recv':>9} {'xfer p50 ms':>11} {'bytes x':>7} {'time x':>7} {'check':>6}"
    )
    lines = [head]
    for r in rows:
        groups = "; ".join(
            f"{g['kind']}: {g['blocks']} x {g['block_bytes']:,}" for g in r["groups"]
        )
        # "-": no peer row of that length was measured (the peer model did not run)
        bytes_x = f"{r['bytes_ratio']:.3f}" if "bytes_ratio" in r else "-"
        time_x = f"{r['time_ratio']:.2f}" if "time_ratio" in r else "-"
        lines.append(
            f"{r['model']:>15} {r['prompt_tokens']:>6} {groups:>52} {_mib(r['formula_bytes']):>11} "
            f"{_mib(r['bytes_received']):>9} {r['transfer_s'] * 1e3:>11.2f} "
            f"{bytes_x:>7} {time_x:>7} "
            f"{'ok' if r['bytes_received'] == r['formula_bytes'] else 'BYTES':>6}"
        )
    return "\n".join(lines)


def add_peer_ratios(rows: list[MeasuredRow], peer: str) -> None:
    """Set bytes_ratio and time_ratio of every row against the `peer` model's row of the same
    prompt length (in place); rows without such a peer keep none."""
    base = {r["prompt_tokens"]: r for r in rows if r["model"] == peer}
    for r in rows:
        b = base.get(r["prompt_tokens"])
        if b is not None and b["bytes_received"] and b["transfer_s"]:
            r["bytes_ratio"] = r["bytes_received"] / b["bytes_received"]
            r["time_ratio"] = r["transfer_s"] / b["transfer_s"]
