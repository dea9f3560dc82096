"""`pdkv bench handoff --transfer-modes pull,push`: one request's TTFT with each transfer mode of
the P2P connector (issue 29), P and D as processes (pdkv.bench.handoff.peer), optionally over a
tbf-capped link between two network namespaces (`--link-rate`, as the handoff benchmark).

Per prompt length and mode, from this driver's clock:
- pull: P's prefill leg (max_tokens=1, P holds its blocks), then D's decode leg (D pulls the
  prompt's KV after P's last layer, then computes the last prompt token);
- push: D admits the request first and opens its write window, P's prefill leg pushes each layer
  into D's blocks as its forward computes it, then D computes the last prompt token.
TTFT is from the driver's first message to D's first token (max_tokens=1), both on the machine's
monotonic clock (one clock for every process, namespaces included).
Exposed transfer = TTFT − P's prefill − D's first step (D's own compute of the request): what
the handoff adds that the model's compute does not hide (the issue's definition). A warm-up
request per mode pays the connections first. The table prints push / pull ratios of TTFT and of
the exposed transfer for each length.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TypedDict

from pdkv.bench.handoff.procs import (
    BLOCK_TOKENS,
    Peer,
    capped_lengths,
    link_unavailable,
    peers,
    prompt_tokens,
)
from pdkv.bench.netns import NetnsPair

MODES = ("pull", "push")


@dataclass(frozen=True)
class ModeRow:
    """One request's handoff in one mode. Times in seconds, bytes in bytes."""

    mode: str
    prompt_tokens: int
    ttft_s: float
    prefill_s: float  # P's prefill leg, as P timed it
    d_first_step_s: float  # D's own compute of the request
    transfer_s: float  # D's KV wait as D's connector timed it (pull: the read; push: window)
    nbytes: float

    @property
    def exposed_s(self) -> float:
        """TTFT − P's prefill − D's first step (never below 0)."""
        return max(0.0, self.ttft_s - self.prefill_s - self.d_first_step_s)


class ModesResult(TypedDict, total=False):
    """What `run_modes_bench` returns (or only `skipped`). `timeline`: the last push request of
    the longest prompt, per layer [layer, its forward ended on P, its write started, ended], in
    seconds from P's prefill leg's start."""

    config: dict[str, object]
    rows: list[dict[str, object]]
    timeline: dict[str, object]
    skipped: str


def _pull(p: Peer, d: Peer, ids: list[int]) -> ModeRow:
    t0 = time.monotonic()
    pre = json.loads(p.call({"prompt_token_ids": ids}))
    got = json.loads(d.call({"prompt_token_ids": ids,
                             "kv_transfer_params": pre["kv_transfer_params"]}))
    ttft = got["first_token_at"] - t0
    return ModeRow("pull", len(ids), ttft, pre["prefill_s"], got["first_step_s"],
                   sum(got["transfer_seconds"]), got["bytes"])


def _push(p: Peer, d: Peer, ids: list[int], timeline: list[list[float]] | None = None
          ) -> ModeRow:
    t0 = time.monotonic()
    opened = json.loads(d.call({"open": True, "prompt_token_ids": ids}))
    pre = json.loads(p.call({"prompt_token_ids": ids,
                             "push_grant": opened["push_grant"]}))
    got = json.loads(d.call({"finish": opened["request_id"],
                             "prompt_token_ids": []}))
    ttft = got["first_token_at"] - t0
    if timeline is not None:
        timeline[:] = pre.get("push_timeline") or []
    return ModeRow("push", len(ids), ttft, pre["prefill_s"], got["first_step_s"],
                   sum(got["transfer_seconds"]), got["bytes"])


def format_rows(rows: list[ModeRow]) -> str:
    """The table: one line per request, then per prompt length the medians of each mode and
    the push / pull ratios of the medians (TTFT and exposed transfer)."""
    lines = ["| prompt | mode | TTFT ms | P prefill ms | D first step ms | exposed ms | KV MB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.prompt_tokens} | {r.mode} | {r.ttft_s * 1e3:.0f} | "
                     f"{r.prefill_s * 1e3:.0f} | {r.d_first_step_s * 1e3:.0f} | "
                     f"{r.exposed_s * 1e3:.0f} | {r.nbytes / 1e6:.1f} |")
    lines += ["", "| prompt | requests per mode | median TTFT pull / push ms | TTFT push/pull | "
              "median exposed pull / push ms | exposed push/pull |", "|---|---|---|---|---|---|"]
    for n in sorted({r.prompt_tokens for r in rows}):
        by = {m: [r for r in rows if r.prompt_tokens == n and r.mode == m] for m in MODES}
        if not by["pull"] or not by["push"]:
            continue
        ttft = {m: statistics.median(r.ttft_s for r in by[m]) for m in MODES}
        exp = {m: statistics.median(r.exposed_s for r in by[m]) for m in MODES}
        ratio_exp = f"{exp['push'] / exp['pull']:.2f}" if exp["pull"] > 0 else ""
        lines.append(f"| {n} | {len(by['push'])} | {ttft['pull'] * 1e3:.0f} / "
                     f"{ttft['push'] * 1e3:.0f} | {ttft['push'] / ttft['pull']:.2f} | "
                     f"{exp['pull'] * 1e3:.0f} / {exp['push'] * 1e3:.0f} | {ratio_exp} |")
    return "\n".join(lines)


def run_modes_bench(modes: Sequence[str] = MODES, prompt_lens: Sequence[int] = (2048,),
                    link_rate: str | None = None, seed: int = 0, repeats: int = 1,
                    print_table: bool = True) -> ModesResult:
    """Measure TTFT per transfer mode and prompt length (module doc); tcp transfer engine.

    Args:
        modes: from MODES.
        prompt_lens: prompt tokens (clipped to 8191).
        link_rate: tc rate of the P-D link (e.g. "1gbit"): P and D in two network namespaces
            (root and iproute2; otherwise the run is skipped with the reason); None: loopback.
        seed: prompt token seed (each length and repeat has its own prompt).
        repeats: requests per (length, mode); each is a row.
        print_table: print progress and the table.

    Returns:
        {"config", "rows": ModeRow fields + exposed_s} or {"skipped": reason}.

    Raises:
        ValueError: an unknown mode, bad lengths or repeats < 1.
        RuntimeError: a peer failed or timed out.
    """
    modes = list(dict.fromkeys(modes))
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"transfer modes must be from {MODES}, got {modes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    lens = capped_lengths(prompt_lens)
    say = print if print_table else (lambda *a, **k: None)
    reason = link_unavailable(link_rate, say)
    if reason:
        return {"skipped": reason}
    rows: list[ModeRow] = []
    layers: list[list[float]] = []  # the last push request's timeline
    with tempfile.TemporaryDirectory(prefix="pdkv-modes-") as log_dir, \
            (NetnsPair(rate=link_rate) if link_rate else contextlib.nullcontext()) as pair:
        if pair is not None:
            say(f"namespaces {pair.ns('p')} ({pair.host('p')}) and {pair.ns('d')} "
                f"({pair.host('d')}); {pair.qdisc('p')}")
        for mode in modes:
            say(f"[{mode}] starting P and D ...", flush=True)
            with peers("tcp", lens, pair, log_dir, mode) as (p, d):
                def one(ids: list[int], push: bool = mode == "push") -> ModeRow:
                    return _push(p, d, ids, layers) if push else _pull(p, d, ids)

                one(prompt_tokens(BLOCK_TOKENS * 2, seed + 997))  # warm-up: connections
                for i, n in enumerate(lens):
                    for k in range(repeats):
                        row = one(prompt_tokens(n, seed + 100 * i + k))
                        rows.append(row)
                        say(f"[{mode}] {n} tokens: TTFT {row.ttft_s * 1e3:.0f} ms (prefill "
                            f"{row.prefill_s * 1e3:.0f}, exposed {row.exposed_s * 1e3:.0f})",
                            flush=True)
    rows.sort(key=lambda r: (r.prompt_tokens, MODES.index(r.mode)))
    if print_table:
        print()
        print(format_rows(rows))
    result: ModesResult = {
        "config": {"modes": modes, "prompt_lens": lens, "link_rate": link_rate, "seed": seed,
                   "repeats": repeats},
        "rows": [dict(asdict(r), exposed_s=r.exposed_s) for r in rows],
    }
    if layers:
        result["timeline"] = {"prompt_tokens": lens[-1], "layers": layers}
    return result


def plot_timeline(timeline: dict[str, object], path: str, title: str) -> str | None:
    """One push request's per-layer timeline as a PNG at `path`: P's compute of each layer (from
    the previous layer's end) on one lane, its write on the wire on the other. Returns why it was
    not drawn (matplotlib missing, no layers), else None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    layers = timeline.get("layers")
    if not isinstance(layers, list) or not layers:
        return "no push timeline"
    fig, ax = plt.subplots(figsize=(10, 2.6))
    prev = 0.0
    for layer, queued, start, end in sorted(layers, key=lambda x: x[1]):
        ax.broken_barh([(prev, queued - prev)], (10, 8), color="tab:blue" if layer % 2
                       else "tab:cyan")
        ax.broken_barh([(start, end - start)], (0, 8), color="tab:orange" if layer % 2
                       else "tab:red")
        prev = queued
    ax.set_yticks([4, 14], ["wire (write)", "P compute"])
    ax.set_xlabel("seconds from P's prefill leg start")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
