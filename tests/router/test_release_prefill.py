"""The proxy's release of a prefill engine's held blocks (pdkv/router/proxy_protocol.py) reaches
every rank of a P at tp > 1: each rank holds the blocks and frees them only on its own notice."""

from __future__ import annotations

import socket

from pdkv.kv_transfer.connector.p2p_messages import Ack, Notify
from pdkv.kv_transfer.wire import recv_msg, send_msg, start_server, stop_server
from pdkv.router.proxy_protocol import release_prefill


def control_server(seen: list[Notify], ok: bool = True) -> tuple[socket.socket, int]:
    """A stand-in for one P rank's control server: records each notice, answers Ack(ok)."""
    def handle(conn: socket.socket) -> None:
        seen.append(recv_msg(conn, Notify))
        send_msg(conn, Ack(ok))

    srv = start_server("127.0.0.1", 0, handle, "fake-p-rank")
    return srv, srv.getsockname()[1]


def test_release_reaches_every_producer_rank():
    seen0: list[Notify] = []
    seen1: list[Notify] = []
    (s0, p0), (s1, p1) = control_server(seen0), control_server(seen1)
    try:
        params = {
            "remote_host": "127.0.0.1",
            "remote_port": p0,
            "remote_request_id": "r1",
            "remote_nonce": "n1",
            "endpoints": [["127.0.0.1", p0], ["127.0.0.1", p1]],
        }
        assert release_prefill(params)
        for seen in (seen0, seen1):
            assert [(n.request_id, n.kind, n.nonce) for n in seen] == [("r1", "release", "n1")]
    finally:
        stop_server(s0)
        stop_server(s1)


def test_one_rank_refusing_is_reported_and_tp1_params_still_work():
    seen0: list[Notify] = []
    seen1: list[Notify] = []
    (s0, p0), (s1, p1) = control_server(seen0), control_server(seen1, ok=False)
    try:
        params = {"remote_host": "127.0.0.1", "remote_port": p0, "remote_request_id": "r2",
                  "endpoints": [["127.0.0.1", p0], ["127.0.0.1", p1]]}
        assert not release_prefill(params)
        assert len(seen0) == len(seen1) == 1
        assert release_prefill(
            {"remote_host": "127.0.0.1", "remote_port": p0, "remote_request_id": "r3"}
        )
        assert [n.request_id for n in seen0] == ["r2", "r3"] and len(seen1) == 1
    finally:
        stop_server(s0)
        stop_server(s1)
