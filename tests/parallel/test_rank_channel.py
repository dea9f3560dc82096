"""The multiproc executor's TCP transport (pdkv.executor.channel) and the multi-node handshake
(pdkv.executor.nodes) on loopback sockets, no worker processes: framing, deadlines, a peer's
EOF / reset as an error, the leader's refusal of a node with another layout, the rewrite of a
remote rank's KV connector hosts, and the multi-node flags' validation."""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgspec
import pytest

from pdkv.config import KVTransferConfig, ParallelConfig
from pdkv.executor.channel import HEADER, ChannelListener, TcpChannel, connect_channel
from pdkv.executor.messages import ExecuteModel, NodeHello, Shutdown, ToWorker
from pdkv.executor.nodes import (
    NodeLayout,
    accept_remote_ranks,
    at_node_host,
    connect_rank,
    interface_of,
)
from pdkv.sched.output import SchedulerOutput


def pair(io_timeout_s: float = 5.0) -> tuple[TcpChannel, TcpChannel]:
    listener = ChannelListener("127.0.0.1", 0)
    try:
        a = connect_channel(*listener.address, time.monotonic() + 5, io_timeout_s)
        b = listener.accept(5.0, io_timeout_s)
    finally:
        listener.close()
    assert b is not None
    return a, b


def test_frames_keep_their_boundaries_and_typed_messages_round_trip():
    a, b = pair()
    try:
        big = bytes(range(256)) * 4096  # 1 MiB: several TCP segments
        for frame in (b"", b"x", big, b"after"):
            a.send_bytes(frame)
        assert not a.poll(0)
        assert b.poll(1.0)
        assert [b.recv_bytes() for _ in range(4)] == [b"", b"x", big, b"after"]
        assert not b.poll(0)  # nothing buffered beyond the frames read
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToWorker)
        out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[],
                              num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                              finished_req_ids=set())
        b.send_bytes(enc.encode(ExecuteModel(scheduler_output=out)))
        b.send_bytes(enc.encode(Shutdown()))
        got = [dec.decode(a.recv_bytes()) for _ in range(2)]
        assert isinstance(got[0], ExecuteModel) and isinstance(got[1], Shutdown)
        assert got[0].scheduler_output.total_num_scheduled_tokens == 0
    finally:
        a.close()
        b.close()


def test_a_closed_peer_is_eof_and_gone_says_so_without_blocking():
    a, b = pair(io_timeout_s=30.0)
    assert b.gone() is None  # alive and silent: no wait for the io timeout
    a.send_bytes(b"last")
    assert b.gone() is None  # a message waiting is not an end
    assert b.recv_bytes() == b"last"
    a.close()
    assert b.poll(2.0)
    assert b.gone() == "closed the connection"
    with pytest.raises(EOFError, match="closed the connection"):
        b.recv_bytes()
    b.close()
    with pytest.raises(ValueError, match="closed"):
        b.send_bytes(b"x")


def test_a_reset_is_eof_too():
    a, b = pair()
    # SO_LINGER 0: close sends a RST instead of a FIN.
    raw = socket.socket(fileno=a.fileno())
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.detach()
    a._sock.close()
    assert b.poll(2.0)
    with pytest.raises(EOFError):
        b.recv_bytes()
    b.close()


def test_a_frame_that_stops_half_way_fails_at_the_io_deadline():
    listener = ChannelListener("127.0.0.1", 0)
    raw = socket.create_connection(listener.address)
    ch = listener.accept(5.0, io_timeout_s=0.5)
    listener.close()
    assert ch is not None
    try:
        raw.sendall(HEADER.pack(100) + b"only ten b")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="10 of 100 bytes"):
            ch.recv_bytes()
        assert time.monotonic() - t0 < 10  # bounded (the deadline is 0.5 s; a loaded box)
    finally:
        raw.close()
        ch.close()


def test_connect_retries_until_the_listener_is_up_and_fails_at_its_deadline():
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    host, free = port.getsockname()
    port.close()
    with pytest.raises(TimeoutError, match=f"{host}:{free}"):
        connect_channel(host, free, time.monotonic() + 0.5, 1.0)
    result: list[TcpChannel] = []
    t = threading.Thread(target=lambda: result.append(
        connect_channel(host, free, time.monotonic() + 20, 5.0)))
    t.start()
    time.sleep(0.5)
    listener = ChannelListener(host, free)
    ch = listener.accept(20.0, 5.0)
    t.join(20)
    listener.close()
    assert ch is not None and len(result) == 1
    result[0].send_bytes(b"hi")
    assert ch.recv_bytes() == b"hi"
    ch.close()
    result[0].close()


def test_the_leader_accepts_every_remote_rank_and_learns_its_host():
    listener = ChannelListener("127.0.0.1", 0)
    layout = NodeLayout(world_size=4, nnodes=2, node_rank=1, master_addr="127.0.0.1",
                        master_port=listener.address[1] - 1)
    assert list(layout.ranks(0)) == [0, 1] and list(layout.ranks(1)) == [2, 3]
    assert layout.init_method == f"tcp://127.0.0.1:{layout.master_port}"
    joined: list[tuple[TcpChannel, TcpChannel, str]] = []
    threads = [threading.Thread(target=lambda r=r: joined.append(
        connect_rank(layout, r, time.monotonic() + 20, 5.0))) for r in (2, 3)]
    for t in threads:
        t.start()
    remote = accept_remote_ranks(listener, layout, time.monotonic() + 20, 5.0, lambda: None)
    for t in threads:
        t.join(20)
    listener.close()
    assert sorted(remote) == [2, 3]
    for r in remote.values():
        assert r.host == "127.0.0.1" and r.step is not None and r.wakeup is not None
    step, _, host = next(j for j in joined)
    step.send_bytes(b"to the leader")
    assert any(r.step is not None and r.step.poll(2.0) for r in remote.values())
    assert host == "127.0.0.1"
    for r in remote.values():
        r.close()
    for s, w, _ in joined:
        s.close()
        w.close()


def test_the_leader_refuses_a_node_with_another_layout_and_times_out_naming_the_missing():
    listener = ChannelListener("127.0.0.1", 0)
    layout = NodeLayout(world_size=2, nnodes=2, master_addr="127.0.0.1",
                        master_port=listener.address[1] - 1)
    bad = connect_channel(*listener.address, time.monotonic() + 5, 5.0)
    bad.send_bytes(msgspec.msgpack.encode(NodeHello(rank=1, channel="step", host="127.0.0.1",
                                                    world_size=4, nnodes=2)))
    with pytest.raises(ValueError, match="world size 4 over 2 nodes; this engine: 2 over 2"):
        accept_remote_ranks(listener, layout, time.monotonic() + 10, 5.0, lambda: None)
    bad.close()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] \(nodes \[1\]\) did not connect"):
        accept_remote_ranks(listener, layout, time.monotonic() + 0.3, 5.0, lambda: None)
    listener.close()


def test_a_remote_rank_binds_and_advertises_its_node_host():
    p2p = {"kv_connector": "P2PConnector", "kv_role": "kv_consumer",
           "kv_connector_extra_config": {"transfer": "tcp", "kv_host": "10.0.0.12",
                                         "kv_advertise_host": "10.0.0.12"}}
    redis = {"name": "redis", "url": "redis://10.0.0.14:6379/0"}
    pool = {"kv_connector": "KVPoolConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"chunk_size": 32, "tiers": [
                {"name": "mooncake", "master": "10.0.0.14:50051", "local_hostname": "10.0.0.12"},
                redis]}}
    kvt = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_consumer",
                           kv_connector_extra_config={"connectors": [pool, p2p]})
    out = at_node_host(kvt, "10.0.0.13")
    assert out is not None and out.engine_id == kvt.engine_id
    kids = out.kv_connector_extra_config["connectors"]
    assert isinstance(kids, list)
    assert kids[1]["kv_connector_extra_config"] == {
        "transfer": "tcp", "kv_host": "10.0.0.13", "kv_advertise_host": "10.0.0.13"}
    assert kids[0]["kv_connector_extra_config"] == {"chunk_size": 32, "tiers": [
        {"name": "mooncake", "master": "10.0.0.14:50051", "local_hostname": "10.0.0.13"}, redis]}
    wild = KVTransferConfig(kv_connector="P2PConnector", kv_role="kv_producer",
                            kv_connector_extra_config={"kv_host": "0.0.0.0"})
    fixed = at_node_host(wild, "10.0.0.13")
    assert fixed is not None
    assert fixed.kv_connector_extra_config == {"kv_host": "0.0.0.0",
                                               "kv_advertise_host": "10.0.0.13"}
    assert at_node_host(None, "10.0.0.13") is None
    assert interface_of("127.0.0.1") == "lo"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"nnodes": 2, "master_addr": "10.0.0.1", "master_port": 29500}, "must divide"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "master_port": 29500}, "--master-addr"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "master_addr": "10.0.0.1"}, "--master-port"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "master_addr": "10.0.0.1",
      "master_port": 29500}, "node_rank must be in"),
])
def test_multi_node_flags_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_a_headless_rank_whose_leader_is_gone_is_ended_unless_it_ends_by_itself(monkeypatch):
    """LeaderWatch: the wakeup channel's EOF (the leader never writes there) ends a rank that
    does not end within the grace (caught in a collective), and leaves alone one that does."""
    from pdkv.executor import headless
    from pdkv.executor.headless import LeaderWatch

    monkeypatch.setattr(headless, "LEADER_GONE_GRACE_S", 2.0)
    LEADER_GONE_GRACE_S = 2.0
    leader, rank = pair()
    lost: list[str] = []
    done = threading.Event()
    watch = LeaderWatch(rank, 1, done, lost.append)
    rank.send_bytes(b"a wakeup")  # the rank's own sends do not count
    time.sleep(0.3)
    assert lost == []
    leader.close()
    watch.join(LEADER_GONE_GRACE_S + 20)
    assert lost == ["closed the connection"]
    rank.close()

    leader, rank = pair()
    done = threading.Event()
    watch = LeaderWatch(rank, 1, done, lost.append)
    leader.close()
    time.sleep(0.1)
    done.set()  # the worker loop read the leader's Shutdown / EOF in time
    watch.join(LEADER_GONE_GRACE_S + 20)
    assert lost == ["closed the connection"]  # no second call
    rank.close()
