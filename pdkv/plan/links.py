"""Link presets for the handoff estimate: effective bandwidth (bytes/s) and one-way latency (s)."""

from __future__ import annotations

from dataclasses import dataclass, replace

#: Share of an RDMA NIC's line rate a KV transfer reaches. Between vLLM's MooncakeConnector
#: peak (142 GB/s = 71 % of 8×200 Gbit/s RoCE) and the Mooncake Transfer Engine's own figure
#: (87 GB/s on 4×200 Gbit/s = 87 %), ../shared/reference/ANCHORS.md §6.3.
RDMA_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Link:
    """A P→D (or pool→engine) link as the cost model sees it.

    Attributes:
        name: preset name or "custom".
        bandwidth: effective bytes/s one transfer reaches (already after efficiency).
        latency: one-way latency in seconds (a handshake costs two).
        note: where the figures come from.
    """

    name: str
    bandwidth: float
    latency: float
    note: str

    def with_overrides(self, bandwidth: float | None, latency: float | None) -> Link:
        """This link with --link-bandwidth / --link-latency applied (given values are effective)."""
        if bandwidth is None and latency is None:
            return self
        note = self.note
        if bandwidth is not None:
            note = f"--link-bandwidth {bandwidth:g} B/s taken as the effective rate"
        if latency is not None:
            note += f"; --link-latency {latency:g} s"
        return replace(self, name=self.name if bandwidth is None else "custom",
                       bandwidth=bandwidth if bandwidth is not None else self.bandwidth,
                       latency=latency if latency is not None else self.latency, note=note)


def _rdma(gbit: int) -> Link:
    line = gbit * 1e9 / 8
    return Link(
        f"rdma-{gbit}",
        line * RDMA_EFFICIENCY,
        5e-6,
        f"{gbit} Gbit/s NIC = {line / 1e9:g} GB/s line rate × {RDMA_EFFICIENCY:.0%} efficiency "
        "(assumed: between vLLM MooncakeConnector's 71 % and the Mooncake Transfer Engine's 87 % "
        "of line rate), one NIC per rank; 5 µs latency (assumed)",
    )


PRESETS: dict[str, Link] = {
    "tcp-loopback": Link(
        "tcp-loopback", 2.7e9, 50e-6,
        "pdkv's tcp engine over loopback: median 2.84 / 2.69 GB/s for 16 / 256 MiB reads in "
        "a `pdkv bench transfer` run of 2026-12-01 (a 2-core box; later runs read 2.8–4.7 "
        "GB/s: measure yours and pass --link-bandwidth, docs/PD.md 'Transfer engines'); "
        "50 µs latency (assumed)"),
    "shm": Link(
        "shm", 12.5e9, 5e-6,
        "pdkv's shm engine: median 12.53 / 12.91 GB/s for 16 / 256 MiB reads in a `pdkv "
        "bench transfer` run of 2026-12-01 (a 2-core box; later runs read 4.8 GB/s at 256 "
        "MiB, 12.6 at 16: measure yours and pass --link-bandwidth, docs/PD.md 'Transfer "
        "engines'); 5 µs latency (assumed)"),
    "rdma-25": _rdma(25),
    "rdma-100": _rdma(100),
    "rdma-400": _rdma(400),
}


def link(name: str) -> Link:
    """The preset called `name`.

    Raises:
        ValueError: unknown preset.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown link {name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]
