"""Network namespaces as hosts on one machine (root and iproute2 needed; torch-free).

`NetnsBridge` makes one namespace per host of a deployment, joined to a bridge that lives in its
own "switch" namespace, with one veth pair per host:

    host namespace <run>-<host>: eth0 (10.A.B.i/24) ──veth── h<i> in <run>-sw, on bridge br0
    root namespace: pdkv<id> (10.A.B.254/24)        ──veth── c0 in <run>-sw, on bridge br0

`<run>` is `pdkv-<id>` with a random 6-hex-digit id, and the /24 is chosen at random among the
10.0.0.0/8 subnets no route of the root namespace overlaps, so two runs never collide. The root
namespace's port lets this machine's processes (the launcher's health checks, a client, a test)
reach every host at its address. A host's link (its veth pair) may be shaped: a tbf qdisc at
`rate` on both ends (tbf shapes egress, so each end caps one direction), and a `delay` (one
way, per direction). The delay is a netem qdisc on both ends where the kernel has sch_netem;
where it does not (or with `delay_with="delay_line"`), the host's link becomes two veth pairs
joined inside the switch namespace by pdkv's user-space delay line
(pdkv/launch/delay_line.py, one process per run, stopped by `delete`):

    eth0 ──veth── d<i> [delay line] e<i> ──veth── h<i> on br0

A packet between two hosts crosses both hosts' links (so 2 × delay one way).

`cut(host)` takes a host's link down (its veth end on the bridge, so both sides see silence, as
with a pulled cable; the host keeps its address and routes) and `restore(host)` brings it back;
`set_link` does the same from another process that knows only the run name and the host's
index (a test driving `pdkv up --deploy FILE --netns`).

`delete` removes the namespaces (their veth ends go with them, and the root namespace's end with
its peer); it also runs when setup fails half-way.

The helpers (`rate_bytes_per_s`, `unavailable_reason`, `list_namespaces`,
`shape_commands`) are shared with `pdkv.bench.netns.NetnsPair` (`pdkv bench handoff --link-rate`,
`pdkv compare --link-rate`).
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from pdkv.launch.delay_line import DelayLineProcess

IP_TIMEOUT_S = 20.0
"""Deadline of one `ip` / `tc` command, in seconds."""

RELAY_GSO_MAX_SIZE = 60000
"""gso_max_size (bytes) of every host's eth0 and this machine's port when the delay line runs: a
TSO frame then fits tbf's 64 KiB burst and crosses tbf whole, where a larger one is cut into
MTU-sized frames, 40 times as many for the delay line to forward."""

DELAY_WITH = ("auto", "netem", "delay_line")
"""How a link delay is applied: netem where the kernel has it, else the delay line ("auto");
or one of them by name."""

TBF_BURST = "64kb"
"""tbf bucket: bytes that may leave at line speed before the rate applies (small, so a short
transfer is still capped; tbf splits larger GSO packets)."""

TBF_LATENCY = "100ms"
"""tbf queueing limit: packets that would wait longer are dropped."""

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)\s*$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def rate_bytes_per_s(rate: str) -> float:
    """Bytes/s of a tc rate: "1gbit" → 1.25e8, "10gbit" → 1.25e9, "500mbit" → 6.25e7
    (tc's "bit" suffixes are powers of 1000; "bps" means bytes/s, as in tc).

    Raises:
        ValueError: not a number followed by [k|m|g]bit or [k|m|g]bps.
    """
    m = _RATE.match(rate)
    if not m:
        raise ValueError(f"rate must look like 1gbit, 500mbit or 100mbps, got {rate!r}")
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    return value / 8 if m.group(3).lower() == "bit" else value


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`/`tc`), or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2"
    return None


def netem_unavailable_reason() -> str | None:
    """Why a link `delay` cannot be set here (no namespaces, or a kernel without the netem
    qdisc, sch_netem), or None when it can. Probes by adding a netem qdisc to the loopback of
    a throwaway namespace (`pdkv-netem-<random>`, removed again; each command has the
    IP_TIMEOUT_S deadline)."""
    reason = unavailable_reason()
    if reason:
        return reason
    ns = f"pdkv-netem-{random.randrange(16**6):06x}"
    made = run_ip(["ip", "netns", "add", ns], check=False)
    if made.returncode != 0:
        return f"cannot create a namespace to probe netem: {made.stderr.strip()}"
    try:
        res = run_ip(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                      "1ms"], check=False)
    finally:
        run_ip(["ip", "netns", "del", ns], check=False)
    if res.returncode != 0:
        return (f"this kernel has no netem qdisc, sch_netem (`tc qdisc add ... netem`: "
                f"{res.stderr.strip()})")
    return None


def delay_method() -> str:
    """How NetnsBridge's "auto" applies a link delay here: "netem" where the kernel has it
    (netem_unavailable_reason is None), else "delay_line"."""
    return "netem" if netem_unavailable_reason() is None else "delay_line"


def run_ip(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one `ip` / `tc` command with the IP_TIMEOUT_S deadline.

    Raises:
        subprocess.CalledProcessError: `check` and a non-zero exit.
        subprocess.TimeoutExpired: past the deadline.
    """
    return subprocess.run(list(args), check=check, capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S)


def list_namespaces() -> list[str]:
    """Names of the network namespaces `ip netns list` shows."""
    out = run_ip(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def shape_commands(netns: str, dev: str, rate: str | None, delay: str | None,
                   burst: str = TBF_BURST, latency: str = TBF_LATENCY) -> list[list[str]]:
    """The `tc` commands that shape the egress of `dev` in namespace `netns`: tbf at `rate`,
    netem with `delay` (tbf then hangs under netem); none when both are None."""
    tc = ["tc", "-n", netns, "qdisc", "add", "dev", dev]
    tbf = ["tbf", "rate", str(rate), "burst", burst, "latency", latency]
    if delay is None:
        return [tc + ["root", *tbf]] if rate is not None else []
    cmds = [tc + ["root", "handle", "1:", "netem", "delay", delay]]
    if rate is not None:
        cmds.append(tc + ["parent", "1:1", "handle", "10:", *tbf])
    return cmds


def run_all(cmds: Sequence[Sequence[str]]) -> None:
    """Run commands in order, stopping at the first failure.

    Raises:
        RuntimeError: a command failed (it and its stderr named; netem's absence explained).
    """
    for cmd in cmds:
        res = run_ip(cmd, check=False)
        if res.returncode != 0:
            err = res.stderr.strip()
            hint = ""
            if "netem" in cmd and "unknown" in err.lower():
                hint = " (this kernel has no netem qdisc, sch_netem: a link delay cannot be set)"
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {err}{hint}")


def set_link(run_name: str, host_index: int, up: bool) -> None:
    """Bring host number `host_index` of the run `run_name` (`pdkv-<id>`) off or back onto the
    bridge: its veth end `h<i>` in the switch namespace goes down or up. Down, every packet to
    or from the host is dropped silently (open TCP connections see no reset, only silence); up,
    they carry on where they were (the host's addresses and routes are untouched).

    Raises:
        RuntimeError: the `ip` command failed (no such run or host).
    """
    run_all([["ip", "-n", f"{run_name}-sw", "link", "set", f"h{host_index}",
              "up" if up else "down"]])


@dataclass(frozen=True)
class LinkShape:
    """How one host's link is shaped: `rate` in tc syntax ("1gbit"), `delay` one way per
    direction in tc syntax ("1ms"); None leaves it unshaped."""

    rate: str | None = None
    delay: str | None = None


def _free_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    """A random 10.A.B.0/24 that no route of the root namespace overlaps.

    Raises:
        RuntimeError: none found in 64 tries.
    """
    routes = []
    for line in run_ip(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("broadcast", "local", "unicast") and len(line.split()) > 1:
            first = line.split()[1]
        try:
            routes.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            continue  # "default", "multicast", ...
    for _ in range(64):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(64, 250)}.{rng.randrange(1, 255)}.0/24")
        if not any(net.overlaps(r) for r in routes if r.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet found for the namespaces")


class NetnsBridge:
    """One network namespace per host, all on one bridge (see the module doc).

    Args:
        hosts: host names in order (letters, digits, "-", "_"; each ≤ 32 characters); host i
            gets the subnet's address i + 1.
        links: shaping per host name (hosts left out are unshaped).
        seed: seeds the random run id and subnet (tests); None = fresh randomness.
        delay_with: how link delays are applied (DELAY_WITH): "auto" (netem where the kernel
            has it, else the delay line), "netem" or "delay_line".

    Raises (from setup / __enter__):
        RuntimeError: not root or no iproute2 (message from `unavailable_reason`), no free
            subnet, an `ip` / `tc` command failed (its stderr), netem asked for on a kernel
            without it, or the delay line did not start (its output); everything created so
            far is removed first.
    """

    def __init__(self, hosts: Sequence[str], links: Mapping[str, LinkShape] | None = None,
                 seed: int | None = None, delay_with: str = "auto") -> None:
        if delay_with not in DELAY_WITH:
            raise ValueError(f"delay_with must be one of {DELAY_WITH}, got {delay_with!r}")
        if not hosts or len(hosts) > 250:
            raise ValueError(f"1 to 250 hosts, got {len(hosts)}")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"host names must be distinct, got {list(hosts)}")
        for h in hosts:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}", h):
                raise ValueError(f"host name must be 1-32 letters, digits, - or _, got {h!r}")
        self.hosts = tuple(hosts)
        self.links = dict(links or {})
        self._rng = random.Random(seed)
        self.run_id = f"{self._rng.getrandbits(24):06x}"
        self.subnet: ipaddress.IPv4Network | None = None
        self._created: list[str] = []
        self.delay_with = delay_with
        self.delay_method: str | None = None
        """After setup: "netem" or "delay_line" when some link has a delay, else None."""
        self._delay_line: DelayLineProcess | None = None

    @property
    def run_name(self) -> str:
        """Prefix of every namespace this run makes: `pdkv-<id>`."""
        return f"pdkv-{self.run_id}"

    def ns(self, host: str) -> str:
        """The namespace of `host`."""
        return f"{self.run_name}-{host}"

    @property
    def switch_ns(self) -> str:
        """The namespace holding the bridge."""
        return f"{self.run_name}-sw"

    @property
    def root_dev(self) -> str:
        """The root namespace's veth end (interface names are at most 15 characters)."""
        return f"pdkv{self.run_id}"

    def address(self, host: str) -> str:
        """`host`'s address (after setup).

        Raises:
            RuntimeError: before setup.
        """
        if self.subnet is None:
            raise RuntimeError("NetnsBridge.setup() has not run")
        return str(self.subnet.network_address + self.hosts.index(host) + 1)

    @property
    def root_address(self) -> str:
        """This machine's address on the bridge (after setup)."""
        if self.subnet is None:
            raise RuntimeError("NetnsBridge.setup() has not run")
        return str(self.subnet.network_address + 254)

    def exec_prefix(self, host: str) -> list[str]:
        """argv prefix that runs a command inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns(host)]

    def namespaces(self) -> list[str]:
        """Every namespace this run makes."""
        return [self.switch_ns, *(self.ns(h) for h in self.hosts)]

    def setup(self) -> None:
        """Create the namespaces, bridge, veth pairs, addresses and qdiscs (module doc)."""
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot create network namespaces: {reason}")
        try:
            self.subnet = _free_subnet(self._rng)
            sw = self.switch_ns
            plen = self.subnet.prefixlen
            self._add_ns(sw)
            run_all([["ip", "-n", sw, "link", "set", "lo", "up"],
                     ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
                     ["ip", "-n", sw, "link", "set", "br0", "up"]])
            self.delay_method = self._resolve_delay_method()
            pairs: list[str] = []
            for i, host in enumerate(self.hosts):
                ns = self.ns(host)
                self._add_ns(ns)
                shape = self.links.get(host, LinkShape())
                relay = shape.delay is not None and self.delay_method == "delay_line"
                if relay:  # eth0 ── d<i> [delay line] e<i> ── h<i> (module doc)
                    run_all([
                        ["ip", "-n", sw, "link", "add", f"d{i}", "type", "veth", "peer", "name",
                         "eth0", "netns", ns],
                        ["ip", "-n", sw, "link", "add", f"e{i}", "type", "veth", "peer", "name",
                         f"h{i}"],
                        ["ip", "-n", sw, "link", "set", f"d{i}", "up", "promisc", "on"],
                        ["ip", "-n", sw, "link", "set", f"e{i}", "up", "promisc", "on"],
                    ])
                    pairs.append(f"d{i}:e{i}:{shape.delay}")
                else:
                    run_all([["ip", "-n", sw, "link", "add", f"h{i}", "type", "veth", "peer",
                              "name", "eth0", "netns", ns]])
                run_all([
                    ["ip", "-n", sw, "link", "set", f"h{i}", "master", "br0"],
                    ["ip", "-n", sw, "link", "set", f"h{i}", "up"],
                    ["ip", "-n", ns, "addr", "add", f"{self.address(host)}/{plen}", "dev",
                     "eth0"],
                    ["ip", "-n", ns, "link", "set", "eth0", "up"],
                    ["ip", "-n", ns, "link", "set", "lo", "up"],
                ])
                if self.delay_method == "delay_line":
                    run_all([["ip", "-n", ns, "link", "set", "dev", "eth0", "gso_max_size",
                              str(RELAY_GSO_MAX_SIZE)]])
                qdisc_delay = None if relay else shape.delay
                run_all(shape_commands(ns, "eth0", shape.rate, qdisc_delay)
                        + shape_commands(sw, f"h{i}", shape.rate, qdisc_delay))
            if pairs:
                self._delay_line = DelayLineProcess(self.switch_ns, pairs)
            run_all([
                ["ip", "link", "add", self.root_dev, "type", "veth", "peer", "name", "c0",
                 "netns", sw],
                ["ip", "-n", sw, "link", "set", "c0", "master", "br0"],
                ["ip", "-n", sw, "link", "set", "c0", "up"],
                ["ip", "addr", "add", f"{self.root_address}/{plen}", "dev", self.root_dev],
                ["ip", "link", "set", self.root_dev, "up"],
            ])
            if self.delay_method == "delay_line":
                run_all([["ip", "link", "set", "dev", self.root_dev, "gso_max_size",
                          str(RELAY_GSO_MAX_SIZE)]])
        except BaseException:
            self.delete()
            raise

    def _resolve_delay_method(self) -> str | None:
        """"netem" / "delay_line" for this run's delays (None without any): `delay_with`, with
        "auto" resolved by probing netem.

        Raises:
            RuntimeError: "netem" asked for on a kernel without it.
        """
        if not any(shape.delay for shape in self.links.values()):
            return None
        if self.delay_with == "delay_line":
            return "delay_line"
        reason = netem_unavailable_reason()  # as delay_method(), with the reason kept
        if reason is None:
            return "netem"
        if self.delay_with == "netem":
            raise RuntimeError(f"a link delay with netem cannot be set: {reason}")
        return "delay_line"

    def _stop_delay_line(self) -> None:
        line, self._delay_line = self._delay_line, None
        if line is not None:
            line.stop()

    def _add_ns(self, name: str) -> None:
        run_all([["ip", "netns", "add", name]])
        self._created.append(name)

    def delete(self) -> list[str]:
        """Delete what this run made (namespaces, then the root namespace's veth end if it is
        left); returns the names removed. Safe to call twice, or before setup."""
        self._stop_delay_line()
        removed = []
        existing = set(list_namespaces())
        for name in reversed(self._created):
            if name in existing:
                run_ip(["ip", "netns", "del", name], check=False)
                removed.append(name)
        self._created.clear()
        if run_ip(["ip", "link", "show", self.root_dev], check=False).returncode == 0:
            run_ip(["ip", "link", "del", self.root_dev], check=False)
            removed.append(self.root_dev)
        return removed

    def cut(self, host: str) -> None:
        """Take `host`'s link down (`set_link`): it stays up, unreachable, until `restore`."""
        set_link(self.run_name, self.hosts.index(host), up=False)

    def restore(self, host: str) -> None:
        """Bring `host`'s link back up after `cut`."""
        set_link(self.run_name, self.hosts.index(host), up=True)

    def qdiscs(self, host: str) -> str:
        """`tc qdisc show` of `host`'s end of its link (to print what the run uses)."""
        return run_ip(["tc", "-n", self.ns(host), "qdisc", "show", "dev", "eth0"]).stdout.strip()

    def link_text(self, host: str) -> str:
        """`host`'s link as set up, for a log line: its qdiscs, plus "+ delay D by pdkv's delay
        line" where the delay line delays it; "not shaped" when the file shapes nothing."""
        shape = self.links.get(host, LinkShape())
        if not (shape.rate or shape.delay):
            return "not shaped"
        text = self.qdiscs(host)
        if shape.delay and self.delay_method == "delay_line":
            text += f" + delay {shape.delay} by pdkv's delay line"
        return text

    def __enter__(self) -> NetnsBridge:
        self.setup()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.delete()
