"""The server's part of push mode (issue 29; `transfer_mode: push` of the P2P connector): which
transfer mode an engine's connector config asks for (GET /kv_layout's `transfer_mode`, which the
proxy reads to choose the D-first flow) and whether it pushes across block sizes (its
`push_block_sizes`) and D's two routes of the flow, `GET
/v1/kv/push_grant/{request_id}` and `POST /v1/kv/push_first_token/{request_id}` (`add_push_routes`).

D first: the proxy sends the decode leg to D with kv_transfer_params {"do_remote_prefill": true,
"transfer_mode": "push"}; D's scheduler admits it, allocates its prompt's blocks and opens a write
window (`PushGrant`). The proxy asks this route for that window (it waits until the request is
admitted, within a deadline) and sends the prefill leg to P with it. The decode request itself is
the reservation: it holds the blocks, and a client that leaves aborts it as any other request (its
blocks are freed once the window has landed or its lease has passed, never while P may write).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI
from fastapi.responses import Response

from pdkv.engine.async_llm import EngineDeadError
from pdkv.kv_transfer.connector.p2p_messages import PushGrant
from pdkv.kv_transfer.connector.p2p_push_scheduler import push_block_sizes
from pdkv.serve.handlers import APIError
from pdkv.serve.protocol import PushFirstTokenRequest

if TYPE_CHECKING:
    from pdkv.engine.async_llm import AsyncLLM

POLL_FIRST_S = 0.002
"""The first pause between two looks at the engine's open windows; it doubles up to POLL_MAX_S."""
POLL_MAX_S = 0.05
MAX_WAIT_S = 600.0
"""The longest wait a caller may ask for (seconds)."""


def transfer_mode(kv_connector: str, extra: object) -> str:
    """"push" when the connector config is a P2PConnector with kv_connector_extra_config
    transfer_mode "push", or a MultiConnector with such a child (P/D with a KV pool); else
    "pull" (also for other connectors: they do not push)."""
    if kv_connector == "P2PConnector" and isinstance(extra, dict):
        return "push" if extra.get("transfer_mode") == "push" else "pull"
    if kv_connector == "MultiConnector" and isinstance(extra, dict):
        children = extra.get("connectors")
        if isinstance(children, list) and any(
                isinstance(c, dict) and transfer_mode(str(c.get("kv_connector", "")),
                                                      c.get("kv_connector_extra_config")) == "push"
                for c in children):
            return "push"
    return "pull"


def engine_push_block_sizes(llm: AsyncLLM) -> str:
    """GET /kv_layout's `push_block_sizes`: "any" when this engine's KV cache pushes across
    block sizes (one full-attention group: `p2p_push_scheduler.push_block_sizes`), else
    "equal" (a proxy then pushes only to or from an engine of its own block size)."""
    groups = llm.engine.executor.kv_cache_config.groups
    return push_block_sizes(llm.engine.executor.kv_layout,
                            tuple(getattr(g.spec, "sliding_window", None) for g in groups),
                            tuple(g.spec.state_slot for g in groups))


async def wait_push_grant(lookup: Callable[[str], PushGrant | None], request_id: str,
                          timeout_s: float) -> PushGrant | None:
    """The write window of D's request `request_id`, waiting until the scheduler opened it.

    `lookup` reads the scheduler half's open windows (a dict read from the server's thread: a
    snapshot, as GET /kv_events/held reads the prefix cache). The request may not have reached the
    engine yet (its decode leg is in flight) or may wait for free blocks: both keep this waiting,
    looking again after POLL_FIRST_S, doubling to POLL_MAX_S.

    Args:
        lookup: request id -> its open window, or None.
        request_id: D's request id (the decode leg's X-Request-Id).
        timeout_s: how long to wait, seconds (0 < timeout_s <= MAX_WAIT_S).

    Returns:
        The grant, or None when none opened within `timeout_s`.

    Raises:
        ValueError: timeout_s outside (0, MAX_WAIT_S].
    """
    if not 0 < timeout_s <= MAX_WAIT_S:
        raise ValueError(f"timeout must be in (0, {MAX_WAIT_S:g}] seconds, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    pause = POLL_FIRST_S
    while True:
        grant = lookup(request_id)
        if grant is not None:
            return grant
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, POLL_MAX_S)


def _push_connector(llm: AsyncLLM) -> Any:
    """The scheduler half that receives pushes on this engine (a kv_consumer / kv_both
    P2PConnector with transfer_mode "push", alone or as a MultiConnector's child).

    Raises:
        APIError: 404 when this engine receives no pushes.
    """
    kvt = llm.engine.config.kv_transfer_config
    connector = llm.engine.scheduler.connector
    # Under a MultiConnector (P/D with a KV pool) the P2P child owns the windows.
    connector = next((c for c in getattr(connector, "children", [connector])
                      if hasattr(c, "push_grant")), None)
    if (kvt is None or connector is None
            or kvt.kv_role not in ("kv_consumer", "kv_both")
            or transfer_mode(kvt.kv_connector, kvt.kv_connector_extra_config) != "push"):
        raise APIError("this engine receives no pushes (a kv_consumer P2PConnector with "
                       "kv_connector_extra_config.transfer_mode 'push' does)", 404,
                       "NotFoundError")
    return connector


def add_push_routes(app: FastAPI, llm: AsyncLLM) -> None:
    """D's routes of the push flow (pdkv's, vLLM has none) on `app`."""

    @app.get("/v1/kv/push_grant/{request_id}", response_model=None)
    async def push_grant(request_id: str, timeout: float = 30.0) -> dict[str, object]:
        """Push mode, D: the write window of decode request `request_id` (its X-Request-Id),
        `{"push_grant": PushGrant}`, once the scheduler admitted it and allocated its blocks
        (waits up to `timeout` seconds for that: `wait_push_grant`). 404 when this engine does
        not receive pushes; 504 when no window opened in time (the request never arrived, or
        still waits for blocks); 400 for a timeout outside (0, 600]."""
        connector = _push_connector(llm)
        try:
            grant = await wait_push_grant(connector.push_grant, request_id, timeout)
        except ValueError as e:
            raise APIError(str(e), param="timeout") from None
        if grant is None:
            raise APIError(f"no write window opened for request {request_id!r} within "
                           f"{timeout:g} s (not received, or waiting for free KV blocks)", 504,
                           "GatewayTimeout")
        return {"push_grant": msgspec.to_builtins(grant)}

    @app.post("/v1/kv/push_first_token/{request_id}", response_model=None)
    async def push_first_token(request_id: str, body: PushFirstTokenRequest) -> Response:
        """Push mode, D, a model with a linear-state group: P's sampled token for decode request
        `request_id` (P's answer's kv_transfer_params "first_token"); D's window completes once
        it and every pushed layer are here, and the token is the request's first output token.
        200 (empty); 400 for a token outside the vocabulary or a request with no window waiting
        for a token; 404 when this engine receives no pushes; 503 / 504 when the engine is dead
        / did not answer in time."""
        connector = _push_connector(llm)
        if not 0 <= body.first_token < llm.engine.vocab_size:
            raise APIError(f"first_token {body.first_token} is outside the vocabulary",
                           param="first_token")
        try:
            await llm.call_async(
                lambda _: connector.push_first_token(request_id, body.first_token), 10.0)
        except ValueError as e:
            raise APIError(str(e)) from None
        except EngineDeadError as e:
            raise APIError(str(e), 503, "ServiceUnavailableError") from None
        except TimeoutError:
            raise APIError("the engine loop did not answer in time", 504,
                           "GatewayTimeout") from None
        return Response(status_code=200)
