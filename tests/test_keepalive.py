"""Keep-alive between pdkv's clients and servers (pdkv.keepalive): a client that reuses a
connection the server is closing loses its request without an answer (the one "no_answer" of
the third one-hour soak); pdkv's client limits drop an idle connection before the server would.

The server here is a fake that injects the race: a request arriving on a connection idle for
longer than its keep-alive timeout is met with a close, as if the server's FIN had crossed it on
the wire (a real server closes at the timeout; the request sent in that same instant is lost)."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import uvicorn

from pdkv.bench.soak.client import TRANSPORT, send, status_class
from pdkv.bench.soak.workload import Item, SoakRequest
from pdkv.keepalive import CLIENT_KEEPALIVE_EXPIRY_S, SERVER_KEEPALIVE_S, client_limits
from pdkv.router import proxy_cli
from pdkv.serve import api_server

BODY = b'{"choices": [{"index": 0, "text": " ok", "finish_reason": "stop"}]}'


class ClosingServer:
    """HTTP/1.1 on loopback: answers every request with BODY and keeps the connection, except a
    request that arrives after the connection was idle for more than `keepalive_s` seconds: that
    one gets the connection closed, unanswered. Counts connections and answers."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
        self.connections = 0
        self.answered = 0
        self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        loop = asyncio.get_running_loop()
        last = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                if last is not None and loop.time() - last > self.keepalive_s:
                    self.dropped += 1
                    return  # the close that crosses the request
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))
                await writer.drain()
                self.answered += 1
                last = loop.time()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _two_requests(limits: httpx.Limits, server_keepalive_s: float,
                        idle_s: float) -> tuple[list[int], list[str], ClosingServer]:
    """Two soak requests through one client, `idle_s` seconds apart, to a ClosingServer."""
    fake = ClosingServer(server_keepalive_s)
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    req = SoakRequest(Item("k", "completions", "p", 4), "colocated", stream=False, greedy=True)
    statuses, errors = [], []
    try:
        async with httpx.AsyncClient(timeout=10.0, limits=limits) as client:
            for i in range(2):
                if i:
                    await asyncio.sleep(idle_s)
                o = await send(client, f"http://127.0.0.1:{port}", "m", req, 10.0)
                statuses.append(o.status)
                errors.append(o.error)
    finally:
        server.close()
        await server.wait_closed()
    return statuses, errors, fake


def test_a_client_that_outlives_the_servers_keepalive_loses_the_request() -> None:
    """httpx's default pool keeps an idle connection 5 s, as long as uvicorn keeps it: the soak's
    client reused it across the server's close and got no answer (and now says why)."""
    statuses, errors, fake = asyncio.run(
        _two_requests(httpx.Limits(), server_keepalive_s=0.3, idle_s=0.6))
    assert statuses[0] == 200
    assert statuses[1] == TRANSPORT and status_class(statuses[1]) == "no_answer"
    assert "RemoteProtocolError" in errors[1] or "ReadError" in errors[1], errors[1]
    assert (fake.connections, fake.answered, fake.dropped) == (1, 1, 1)


def test_pdkvs_client_limits_drop_an_idle_connection_before_the_server_does() -> None:
    """Idle past CLIENT_KEEPALIVE_EXPIRY_S, a pdkv client opens a new connection; the server (here
    closing at a keep-alive between the two, where the default client loses the request) sees
    no request on a connection it is closing."""
    server_s = CLIENT_KEEPALIVE_EXPIRY_S + 0.2
    idle_s = CLIENT_KEEPALIVE_EXPIRY_S + 0.5
    statuses, errors, fake = asyncio.run(_two_requests(client_limits(4), server_s, idle_s))
    assert statuses == [200, 200], errors
    assert (fake.connections, fake.answered, fake.dropped) == (2, 2, 0)


def test_the_servers_keepalive_outlasts_the_clients() -> None:
    """The order the fix rests on: pdkv's servers keep an idle connection longer than its
    clients do, and both servers pass that timeout to uvicorn."""
    assert CLIENT_KEEPALIVE_EXPIRY_S < SERVER_KEEPALIVE_S
    assert client_limits(None).keepalive_expiry == CLIENT_KEEPALIVE_EXPIRY_S
    assert uvicorn.Config(app=None).timeout_keep_alive >= SERVER_KEEPALIVE_S
    for module in (api_server, proxy_cli):
        assert "timeout_keep_alive=int(SERVER_KEEPALIVE_S)" in inspect.getsource(module), module
