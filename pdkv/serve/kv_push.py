"""The server's part of push mode (issue 29; `transfer_mode: push` of the P2P connector): which
transfer mode an engine's connector config asks for (GET /kv_layout's `transfer_mode`, which the
proxy reads to choose the D-first flow) and the wait behind `GET /v1/kv/push_grant/{request_id}`.

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

from pdkv.kv_transfer.connector.p2p_messages import PushGrant

POLL_FIRST_S = 0.002
"""The first pause between two looks at the engine's open windows; it doubles up to POLL_MAX_S."""
POLL_MAX_S = 0.05
MAX_WAIT_S = 600.0
"""The longest wait a caller may ask for (seconds)."""


def transfer_mode(kv_connector: str, extra: object) -> str:
    """"push" when the connector config is a P2PConnector with kv_connector_extra_config
    transfer_mode "push", else "pull" (also for other connectors: they do not push)."""
    if kv_connector == "P2PConnector" and isinstance(extra, dict):
        return "push" if extra.get("transfer_mode") == "push" else "pull"
    return "pull"


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
