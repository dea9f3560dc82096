"""`pdkv bench handoff`'s arithmetic: `pdkv plan`'s handoff prediction for measured bytes, the
fixed cost taken from a one-block probe, and the measured / predicted ratio (torch-free).

Prediction (pdkv.plan.costs.handoff, the same code as `pdkv plan --kv-bytes B`):
    predicted = B / W + 2 · latency (one handshake round trip) + F
with W and latency from the link preset of the transfer engine (tcp → tcp-loopback, shm → shm),
from a measured --link-bandwidth, or from the tbf rate of a capped link; F is the per-handoff
fixed cost passed as `pdkv plan --sched-overhead F`. F is measured on the box, not assumed: the
pull time of a one-block (16-token) prompt minus its own wire time and handshake term, i.e. the
claim and done round trips and the read's request that every pull pays whatever its size.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv.plan import costs, links

#: The link preset `pdkv plan` uses for each transfer engine over loopback.
ENGINE_PRESETS = {"tcp": "tcp-loopback", "shm": "shm"}
DEFAULT_TOLERANCE = 0.30


def engine_link(transfer: str, bandwidth: float | None = None, rate_bps: float | None = None,
                rate_name: str = "") -> links.Link:
    """The link the prediction uses: a rate-capped link (bandwidth = the tbf rate in bytes/s,
    latency 0, as `pdkv plan --link-bandwidth R`), else the engine's preset, with a measured
    `bandwidth` (bytes/s) replacing the preset's when given.

    Raises:
        ValueError: no preset for `transfer` and no rate.
    """
    if rate_bps is not None:
        return links.Link("custom", rate_bps, 0.0,
                          f"tbf rate {rate_name or rate_bps} = {rate_bps:g} B/s taken as the "
                          "effective rate (`pdkv plan --link-bandwidth`); latency 0")
    if transfer not in ENGINE_PRESETS:
        raise ValueError(
            f"no link preset for transfer {transfer!r}; known: {', '.join(ENGINE_PRESETS)}"
        )
    return links.link(ENGINE_PRESETS[transfer]).with_overrides(bandwidth, None)


def fixed_from_probe(probe_s: float, probe_bytes: float, link: links.Link) -> float:
    """Per-handoff fixed cost (s) from a small pull: its time minus its wire time and the
    plan's handshake term (never below 0)."""
    handshake = costs.FixedCosts().handshake(link)
    return max(0.0, probe_s - probe_bytes / link.bandwidth - handshake)


@dataclass(frozen=True)
class Comparison:
    """Predicted vs measured handoff of one request (seconds, bytes).

    Attributes:
        transfer: transfer engine (tcp, shm, ...).
        link: the prediction's link (preset name or "custom").
        bandwidth: the link's effective bytes/s.
        prompt_len: prompt tokens.
        nbytes: KV bytes D received (kv_bytes_received).
        measured_s: the consumer's transfer time (KVConnectorOutput.transfer_seconds).
        predicted_s: `pdkv plan`'s handoff time for nbytes.
        wire_s: nbytes / bandwidth.
        fixed_s: the fixed term F given to the plan (--sched-overhead).
        prefill_s: P's prefill wall time for the prompt, or None.
    """

    transfer: str
    link: str
    bandwidth: float
    prompt_len: int
    nbytes: float
    measured_s: float
    predicted_s: float
    wire_s: float
    fixed_s: float
    prefill_s: float | None = None

    @property
    def ratio(self) -> float:
        """measured / predicted (1.0 = exact; > 1: slower than predicted)."""
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else float("inf")

    def within(self, tolerance: float = DEFAULT_TOLERANCE) -> bool:
        """|measured − predicted| ≤ tolerance · predicted."""
        return abs(self.measured_s - self.predicted_s) <= tolerance * self.predicted_s

    @property
    def measured_gbps(self) -> float:
        """Effective GB/s of the measured pull (1e9 bytes/s), fixed costs included."""
        return self.nbytes / self.measured_s / 1e9 if self.measured_s > 0 else float("inf")

    def plan_command(self) -> str:
        """The `pdkv plan` invocation that prints this prediction."""
        if self.link == "custom":
            where = f"--link-bandwidth {self.bandwidth:g}"
        else:
            where = f"--link {self.link}"
            preset = links.link(self.link)
            if preset.bandwidth != self.bandwidth:
                where += f" --link-bandwidth {self.bandwidth:g}"
        return f"pdkv plan --kv-bytes {self.nbytes:.0f} {where} --sched-overhead {self.fixed_s:.4g}"


def compare(transfer: str, link: links.Link, prompt_len: int, nbytes: float, measured_s: float,
            fixed_s: float, prefill_s: float | None = None) -> Comparison:
    """Predict the handoff of `nbytes` over `link` with fixed cost `fixed_s` (s) and pair it with
    the measurement.

    Raises:
        ValueError: negative bytes or a non-positive bandwidth (from costs.handoff).
    """
    h = costs.handoff(nbytes, link, costs.FixedCosts(scheduling=fixed_s))
    return Comparison(transfer, link.name, link.bandwidth, prompt_len, nbytes, measured_s, h.total,
                      h.wire, fixed_s, prefill_s)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def format_table(rows: list[Comparison], tolerance: float = DEFAULT_TOLERANCE) -> str:
    """A text table: one line per comparison with the ratio and PASS/FAIL at `tolerance`."""
    head = (f"{'transfer':<8} {'link':<13} {'tokens':>6} {'MB':>7} {'predicted':>10} "
            f"{'measured':>10} {'GB/s':>6} {'ratio':>6} {'±' + format(tolerance, '.0%'):>6} "
            f"{'prefill':>9} {'handoff/prefill':>15}")
    lines = [head, "-" * len(head)]
    for r in rows:
        share = f"{r.measured_s / r.prefill_s:.3f}" if r.prefill_s else "n/a"
        lines.append(
            f"{r.transfer:<8} {r.link:<13} {r.prompt_len:>6} {r.nbytes / 1e6:>7.1f} "
            f"{_ms(r.predicted_s):>10} {_ms(r.measured_s):>10} {r.measured_gbps:>6.2f} "
            f"{r.ratio:>6.2f} {'PASS' if r.within(tolerance) else 'FAIL':>6} "
            f"{(_ms(r.prefill_s) if r.prefill_s else 'n/a'):>9} {share:>15}")
    return "\n".join(lines)
