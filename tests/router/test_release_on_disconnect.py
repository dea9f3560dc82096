"""A real prefill engine (SmolLM2, lease 600 s) behind the proxy: a client that leaves during the
prefill leg, after P finished the prefill and holds its blocks under a grant, gets those blocks
freed at once (the proxy releases the grant P's answer names), not at lease expiry."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import pytest
from fake_engines import FakeEngine, ServerThread, metric

from pdkv.router.proxy import build_proxy_app

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
from server_utils import RemoteServer  # noqa: E402

pytestmark = pytest.mark.slow

BLOCKS = 64
LEASE_S = 600.0


class HoldingRelay:
    """A TCP relay to 127.0.0.1:`port` that holds back every answer to a POST until `release()`
    (`answered` is set when the first such answer arrived): the fault that lets a client leave
    after P finished but before the proxy read P's answer."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.answered = threading.Event()
        self.passing = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self.passing.set()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            post = threading.Event()  # the request in flight on this connection is a POST
            threading.Thread(target=self._relay, args=(down, up, self._requests(post)),
                             daemon=True).start()
            threading.Thread(target=self._relay, args=(up, down, self._answers(post)),
                             daemon=True).start()

    @staticmethod
    def _requests(post: threading.Event) -> Callable[[bytes], bool]:
        def see(data: bytes) -> bool:
            if data.startswith(b"POST "):
                post.set()
            return True

        return see

    def _answers(self, post: threading.Event) -> Callable[[bytes], bool]:
        def hold(data: bytes) -> bool:
            if post.is_set():
                self.answered.set()
                return self.passing.wait(60)
            return True

        return hold

    @staticmethod
    def _relay(src: socket.socket, dst: socket.socket, before: Callable[[bytes], bool]) -> None:
        """Copy `src` to `dst` until either closes; `before(data)` False ends the copy."""
        with src, dst:
            while True:
                try:
                    data = src.recv(65536)
                except OSError:
                    return
                if not data or not before(data):
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return

    def stop(self) -> None:
        self.passing.set()
        self.listener.close()


def _wait(what: str, ok: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_client_gone_during_the_prefill_leg_frees_ps_blocks_well_before_the_lease():
    config = json.dumps({"kv_connector": "P2PConnector", "kv_role": "kv_producer",
                         "kv_connector_extra_config": {"transfer": "tcp",
                                                       "kv_lease_duration": LEASE_S}})
    with RemoteServer(["serve", "--model", "smollm2", "--num-kv-blocks", str(BLOCKS),
                       "--max-model-len", "256", "--kv-transfer-config", config]) as p:
        relay = HoldingRelay(p.port)
        d = FakeEngine(None)  # never reached: no layout to check against P's
        proxy = ServerThread(build_proxy_app([relay.url], [d.url]))
        try:
            body = json.dumps({"prompt": "The capital of France is " * 8, "max_tokens": 4})
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
                client.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: gone-real\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body.encode())
                )
                assert relay.answered.wait(60), "P did not answer the prefill leg"
                _wait("P holds no blocks for the finished prefill",
                      lambda: metric(p.url, "pdkv:num_blocks_held_for_remote") > 0, 30)
            _wait("the proxy did not see the client leave", lambda: metric(
                proxy.url, "pdkv:proxy_client_disconnects_total", phase="prefill") == 1, 30)
            relay.release()  # P's answer reaches the proxy only now
            _wait("P still holds the blocks (left to the 600 s lease)",
                  lambda: metric(p.url, "pdkv:num_free_blocks") == BLOCKS, 30)
            assert metric(p.url, "pdkv:num_blocks_held_for_remote") == 0
            assert metric(p.url, "pdkv:kv_lease_expirations_total") == 0
            assert d.hits["decode"] == 0
        finally:
            proxy.stop()
            relay.stop()
            d.stop()
