"""Two network namespaces joined by a veth pair, with a token-bucket rate cap: a weak network on
one machine (root and iproute2 needed; torch-free).

    with NetnsPair(prefix="pdkvh", rate="1gbit") as pair:
        subprocess.run(pair.exec_prefix("p") + ["python", ...])   # P on pair.host("p")
        subprocess.run(pair.exec_prefix("d") + ["python", ...])   # D on pair.host("d")

Layout: namespaces `<prefix>-p` and `<prefix>-d`; veth ends `<prefix>-p0` (in -p, 10.77.0.1/30)
and `<prefix>-d0` (in -d, 10.77.0.2/30); loopback up in both; each end carries
`tc qdisc ... root tbf rate <rate> burst <burst> latency <latency>` when a rate is given (tbf
shapes egress, so both ends cap their direction). netem is not used (it does not work on every
kernel this runs on; tbf does). The helpers are shared with `pdkv up --deploy --netns`
(pdkv.launch.netns). Everything created is deleted on exit, also when setup fails
half-way, and names left by an earlier crashed run are removed before setup.
"""

from __future__ import annotations

import re
from types import TracebackType

from pdkv.launch.netns import (
    TBF_BURST,
    TBF_LATENCY,
    list_namespaces,
    rate_bytes_per_s,
    shape_commands,
    unavailable_reason,
)
from pdkv.launch.netns import run_ip as _run

#: Addresses of the P and D ends (a /30 of the 10/8 private range).
DEFAULT_ADDRESSES = {"p": "10.77.0.1", "d": "10.77.0.2"}
PREFIX_LEN = 30


class NetnsPair:
    """Namespaces `<prefix>-p` / `<prefix>-d` joined by a veth pair, optionally rate-capped.

    Args:
        prefix: name prefix (≤ 11 characters: interface names are limited to 15).
        rate: tc rate of the tbf qdisc on both veth ends (e.g. "1gbit"), or None for no cap.
        burst: tbf bucket size (tc syntax): bytes that may leave at line speed before the rate
            applies (kept small so a short transfer is still capped; tbf splits larger GSO
            packets).
        latency: tbf queueing limit (tc syntax): packets that would wait longer are dropped.
        addresses: {"p": ip, "d": ip} within one /30.

    Raises (from setup / __enter__):
        RuntimeError: not root or no iproute2 (message from `unavailable_reason`), or an `ip`/
            `tc` command failed (its stderr; everything created so far is removed first).
    """

    def __init__(self, prefix: str = "pdkvh", rate: str | None = None, burst: str = TBF_BURST,
                 latency: str = TBF_LATENCY, addresses: dict[str, str] | None = None) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,10}", prefix):
            raise ValueError(f"prefix must be 1-11 lowercase letters/digits, got {prefix!r}")
        if rate is not None:
            rate_bytes_per_s(rate)
        self.prefix = prefix
        self.rate = rate
        self.burst = burst
        self.latency = latency
        self.addresses = dict(addresses or DEFAULT_ADDRESSES)
        self.active = False

    def ns(self, side: str) -> str:
        """Namespace name of side "p" or "d"."""
        return f"{self.prefix}-{side}"

    def dev(self, side: str) -> str:
        """Veth end (interface) name inside side's namespace."""
        return f"{self.prefix}-{side}0"

    def host(self, side: str) -> str:
        """The address of side's veth end."""
        return self.addresses[side]

    def exec_prefix(self, side: str) -> list[str]:
        """argv prefix that runs a command inside side's namespace."""
        return ["ip", "netns", "exec", self.ns(side)]

    def cleanup(self) -> list[str]:
        """Delete this pair's namespaces (their veth ends go with them) and a veth end left in
        the root namespace; returns the names removed. Safe to call when nothing exists."""
        removed = []
        existing = set(list_namespaces())
        for side in ("p", "d"):
            if self.ns(side) in existing:
                _run(["ip", "netns", "del", self.ns(side)], check=False)
                removed.append(self.ns(side))
        for side in ("p", "d"):
            if _run(["ip", "link", "show", self.dev(side)], check=False).returncode == 0:
                _run(["ip", "link", "del", self.dev(side)], check=False)
                removed.append(self.dev(side))
        self.active = False
        return removed

    def setup(self) -> None:
        """Create the namespaces, the veth pair, addresses and qdiscs (see the module doc)."""
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot create network namespaces: {reason}")
        self.cleanup()  # stale names from a run that died before its teardown
        self.active = True
        p, d = self.ns("p"), self.ns("d")
        cmds = [
            ["ip", "netns", "add", p],
            ["ip", "netns", "add", d],
            ["ip", "link", "add", self.dev("p"), "type", "veth", "peer", "name", self.dev("d")],
            ["ip", "link", "set", self.dev("p"), "netns", p],
            ["ip", "link", "set", self.dev("d"), "netns", d],
        ]
        for side in ("p", "d"):
            ns = self.ns(side)
            cmds += [
                [
                    "ip",
                    "-n",
                    ns,
                    "addr",
                    "add",
                    f"{self.host(side)}/{PREFIX_LEN}",
                    "dev",
                    self.dev(side),
                ],
                ["ip", "-n", ns, "link", "set", self.dev(side), "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
            ]
            cmds += shape_commands(ns, self.dev(side), self.rate, None, self.burst, self.latency)
        try:
            for cmd in cmds:
                res = _run(cmd, check=False)
                if res.returncode != 0:
                    raise RuntimeError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")
        except BaseException:
            self.cleanup()
            raise

    def qdisc(self, side: str) -> str:
        """`tc qdisc show` of side's veth end (to print what the run used)."""
        return _run(
            ["tc", "-n", self.ns(side), "qdisc", "show", "dev", self.dev(side)]
        ).stdout.strip()

    def __enter__(self) -> NetnsPair:
        self.setup()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cleanup()
