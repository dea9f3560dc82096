"""HTTP keep-alive between pdkv's own clients and servers.

A server closes a connection that has been idle for its keep-alive timeout. A client that keeps
the same connection idle for as long may send its next request just as the server closes it:
the request crosses the server's FIN on the wire and gets no answer at all (httpx raises
RemoteProtocolError "Server disconnected without sending a response", or a ReadError). Nothing
on either side is wrong, and a POST is not retried, so the request is lost. The fix, as for any
proxy in front of a keep-alive server, is an order: every client drops an idle connection well
before the server would (`CLIENT_KEEPALIVE_EXPIRY_S` < `SERVER_KEEPALIVE_S`).
"""

from __future__ import annotations

import httpx

SERVER_KEEPALIVE_S = 5.0
"""Seconds `pdkv serve` and `pdkv proxy` keep an idle client connection open (uvicorn's
`timeout_keep_alive`; 5 s is uvicorn's default and vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE)."""

CLIENT_KEEPALIVE_EXPIRY_S = 2.0
"""Seconds pdkv's HTTP clients (the proxy's legs to its engines, `pdkv bench serve`, the soak and
the chaos load) reuse an idle connection: under SERVER_KEEPALIVE_S with room for a loaded box's
delays, so the client always drops a connection before the server closes it."""


def client_limits(max_connections: int | None,
                  max_keepalive_connections: int | None = None) -> httpx.Limits:
    """httpx pool limits for a pdkv client of a pdkv (or vLLM) server: at most `max_connections`
    connections (None: no limit), of which `max_keepalive_connections` idle (None: all), each
    idle one dropped after CLIENT_KEEPALIVE_EXPIRY_S seconds."""
    return httpx.Limits(max_connections=max_connections,
                        max_keepalive_connections=max_keepalive_connections,
                        keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)
