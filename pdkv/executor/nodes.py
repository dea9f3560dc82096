"""TP/DCP ranks on several hosts: which node holds which ranks, how remote ranks join the
leader, and what a rank changes when it runs on another host (torch-free).

vLLM's multi-node flags (`ParallelConfig`: nnodes, node_rank, master_addr, master_port) split
the world's ranks evenly: node n holds ranks [n·k, (n+1)·k) with k = world / nnodes. Node 0,
the leader, runs the engine (scheduler, executor) and spawns its own ranks as processes with
pipes; each other node runs `pdkv serve ... --headless` (pdkv.executor.headless), whose rank
processes connect to the leader's control listener at master_addr:master_port + 1 with two TCP
channels each (step, wakeup; pdkv.executor.channel), each opened by a `NodeHello`.
torch.distributed (gloo) meets at master_addr:master_port; gloo's interface on every node is
the one holding the node's address (`GLOO_SOCKET_IFNAME`, unless set). A remote rank's KV
connector servers (P2P control and data servers, KV pool lookup server) bind and advertise its
node's address (`at_node_host`).
"""

from __future__ import annotations

import array
import dataclasses
import fcntl
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pdkv.config import KVTransferConfig, ParallelConfig
from pdkv.executor.channel import DEAD_PEER_S, ChannelListener, TcpChannel, connect_channel
from pdkv.executor.messages import NodeHello

HEADLESS_DEAD_PEER_S = 3 * DEAD_PEER_S
"""How long (seconds) a headless node's rank waits on a silent leader before giving up: longer
than the leader waits on it, so that after a cut link the engine reports the lost rank first
(its error is the one users see; the node then ends too)."""

ACCEPT_POLL_S = 0.5
"""How often (seconds) the leader checks its own ranks while it waits for remote ones."""

WILDCARDS = ("", "0.0.0.0", "::")

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class NodeLayout:
    """The ranks of `world_size` split over `nnodes` nodes (see the module doc)."""

    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0

    @classmethod
    def of(cls, par: ParallelConfig) -> NodeLayout:
        """The layout of a parallel config (validated by ParallelConfig)."""
        return cls(par.world_size, par.nnodes, par.node_rank, par.master_addr, par.master_port)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def ranks(self, node: int) -> range:
        """The global ranks of node `node`."""
        k = self.ranks_per_node
        return range(node * k, (node + 1) * k)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def control_address(self) -> tuple[str, int]:
        """The leader's control listener: (master_addr, master_port + 1)."""
        return self.master_addr, self.master_port + 1

    @property
    def init_method(self) -> str:
        """torch.distributed's rendezvous at the leader."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


@dataclass
class RemoteRank:
    """A rank of a headless node as the leader holds it: its two channels and its node's
    address."""

    rank: int
    host: str
    step: TcpChannel | None = None
    wakeup: TcpChannel | None = None

    def close(self) -> None:
        for ch in (self.step, self.wakeup):
            if ch is not None:
                ch.close()


def accept_remote_ranks(listener: ChannelListener, layout: NodeLayout, deadline: float,
                        io_timeout_s: float, check: Callable[[], None]) -> dict[int, RemoteRank]:
    """Wait until every rank of nodes 1 .. nnodes-1 has opened both channels.

    `check` runs every ACCEPT_POLL_S (it raises when a local rank died). A connection whose
    hello is not a valid `NodeHello` of this layout is refused (closed) and waited past.

    Raises:
        TimeoutError: some ranks did not connect by `deadline` (time.monotonic()), named.
        ValueError: a node started with another world size or node count (named).
    """
    want = {r for n in range(1, layout.nnodes) for r in layout.ranks(n)}
    got: dict[int, RemoteRank] = {}
    decoder = msgspec.msgpack.Decoder(NodeHello)
    try:
        while any(got.get(r) is None or got[r].step is None or got[r].wakeup is None
                  for r in want):
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(r for r in want if r not in got or got[r].step is None
                                 or got[r].wakeup is None)
                raise TimeoutError(
                    f"ranks {missing} (nodes {sorted({layout.node_of(r) for r in missing})}) did "
                    f"not connect to {layout.control_address[0]}:{layout.control_address[1]} in "
                    "time: start `pdkv serve ... --headless` on those nodes")
            ch = listener.accept(min(ACCEPT_POLL_S, left), io_timeout_s)
            if ch is None:
                continue
            try:
                if not ch.poll(min(io_timeout_s, max(0.0, deadline - time.monotonic()))):
                    raise EOFError("no hello")
                hello = decoder.decode(ch.recv_bytes())
            except (EOFError, OSError, TimeoutError, msgspec.DecodeError):
                ch.close()
                continue
            if hello.world_size != layout.world_size or hello.nnodes != layout.nnodes:
                ch.close()
                raise ValueError(
                    f"a node at {hello.host} runs world size {hello.world_size} over "
                    f"{hello.nnodes} nodes; this engine: {layout.world_size} over {layout.nnodes}"
                    " (give both the same -tp / -dcp / --nnodes)")
            if hello.rank not in want or hello.channel not in ("step", "wakeup"):
                ch.close()
                continue
            ch.peer = f"rank {hello.rank} at {hello.host}"
            remote = got.setdefault(hello.rank, RemoteRank(hello.rank, hello.host))
            old = getattr(remote, hello.channel)
            if old is not None:  # a restarted node: the newer connection wins
                old.close()
            setattr(remote, hello.channel, ch)
            remote.host = hello.host
    except BaseException:
        for remote in got.values():
            remote.close()
        raise
    return got


def connect_rank(layout: NodeLayout, rank: int, deadline: float,
                 io_timeout_s: float) -> tuple[TcpChannel, TcpChannel, str]:
    """A headless rank's (step, wakeup) channels to the leader and its node's address (the
    local address of the step connection), each channel opened by its `NodeHello`.

    Raises:
        TimeoutError: the leader did not accept by `deadline` (time.monotonic()).
        OSError: a hello could not be sent.
    """
    host, port = layout.control_address
    leader = f"the leader {host}:{port}"
    step = connect_channel(host, port, deadline, io_timeout_s, leader, HEADLESS_DEAD_PEER_S)
    try:
        node_host = step.local_address()
        wake = connect_channel(host, port, deadline, io_timeout_s, leader, HEADLESS_DEAD_PEER_S)
    except BaseException:
        step.close()
        raise
    for ch, name in ((step, "step"), (wake, "wakeup")):
        ch.send_bytes(msgspec.msgpack.encode(NodeHello(
            rank=rank, channel=name, host=node_host, world_size=layout.world_size,
            nnodes=layout.nnodes)))
    return step, wake, node_host


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds IPv4 `address`, or None."""
    if ":" in address:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue
            if socket.inet_ntoa(req.tobytes()[20:24]) == address:
                return name
    return None


def use_gloo_interface(node_host: str) -> None:
    """Point gloo at the interface holding `node_host` (GLOO_SOCKET_IFNAME), unless the user
    set it: gloo's default (the machine's host name) may resolve to an address the other
    nodes cannot reach. Left alone when no interface holds the address."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_of(node_host)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def at_node_host(kvt: KVTransferConfig | None, host: str) -> KVTransferConfig | None:
    """`kvt` for a rank on the node at `host`: every P2PConnector's kv_host becomes `host`
    (a wildcard bind stays) and its kv_advertise_host `host`, and every KVPoolConnector's
    mooncake tier's local_hostname `host` (its client binds there), inside a MultiConnector
    too. None stays None; other connectors are unchanged."""
    if kvt is None:
        return None

    def fix(cfg: dict[str, object]) -> dict[str, object]:
        extra = dict(cfg.get("kv_connector_extra_config") or {})  # type: ignore[call-overload]
        if cfg.get("kv_connector") == "P2PConnector":
            if str(extra.get("kv_host", "127.0.0.1")) not in WILDCARDS:
                extra["kv_host"] = host
            extra["kv_advertise_host"] = host
        elif cfg.get("kv_connector") == "KVPoolConnector":
            tiers = extra.get("tiers")
            if isinstance(tiers, list):
                extra["tiers"] = [{**t, "local_hostname": host}
                                  if isinstance(t, dict) and t.get("name") == "mooncake" else t
                                  for t in tiers]
        elif cfg.get("kv_connector") == "MultiConnector":
            children = extra.get("connectors")
            if isinstance(children, list):
                extra["connectors"] = [fix(c) if isinstance(c, dict) else c for c in children]
        return {**cfg, "kv_connector_extra_config": extra}

    top = fix({"kv_connector": kvt.kv_connector,
               "kv_connector_extra_config": kvt.kv_connector_extra_config})
    extra = top["kv_connector_extra_config"]
    assert isinstance(extra, dict)
    return dataclasses.replace(kvt, kv_connector_extra_config=extra)
