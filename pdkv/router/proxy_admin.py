"""The proxy's deployment-wide admin routes: an engine admin route that means something for the
whole deployment is sent to every backend the proxy routes to, and the answer reports each one.

Fanned out: `POST /reset_prefix_cache` (vLLM's route; every prefill and decode engine, or every
colocated instance, forgets its prefix cache). Not fanned out: `/v1/models`, `/tokenize`,
`/detokenize` (every engine serves one model: the first decode engine answers), `/health`
(aggregated: 200 only when every backend is healthy and every P/D pair's layouts agree; the body
lists each backend's state), `/metrics` (the proxy's own; `/backends` lists the engines to
scrape).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypedDict

import httpx
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

FANNED_OUT_ROUTES = ("/reset_prefix_cache",)
"""Engine admin routes the proxy sends to every backend (POST)."""
FAN_OUT_TIMEOUT_S = 30.0
"""Deadline of each backend's answer (s): above the engine's own 10 s for a reset."""


class BackendAnswer(TypedDict):
    """One backend's answer to a fanned-out route (`status`: HTTP, 502 when unreachable;
    `message`: None on success)."""

    url: str
    role: str
    status: int
    message: str | None


def _message(r: httpx.Response) -> str | None:
    """The error message of an engine's OpenAI error JSON (the raw text otherwise)."""
    if r.status_code == 200:
        return None
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:500] or f"HTTP {r.status_code}"


async def fan_out(client: httpx.AsyncClient, backends: list[tuple[str, str]], path: str,
                  headers: dict[str, str], timeout_s: float = FAN_OUT_TIMEOUT_S) -> JSONResponse:
    """POST `path` to every backend at once and report each answer.

    Args:
        client: the proxy's client.
        backends: (role, base URL) of every engine ("prefill", "decode" or "backend").
        path: the route (one of FANNED_OUT_ROUTES).
        headers: passed on (Authorization).
        timeout_s: deadline per backend (s).

    Returns:
        200 when every backend answered 200; otherwise the highest status among them (an
        unreachable backend counts as 502), with an OpenAI error object naming the backends that
        did not succeed. The body lists every backend: {"url", "role", "status", "message"}
        (message None on success), in the order given.
    """

    async def one(role: str, url: str) -> BackendAnswer:
        try:
            r = await client.post(url + path, headers=headers, timeout=timeout_s)
        except httpx.HTTPError as e:
            logger.warning("502: POST %s to %s %s failed: %s: %s", path, role, url,
                           type(e).__name__, e)
            return {
                "url": url,
                "role": role,
                "status": 502,
                "message": f"unreachable: {type(e).__name__}: {e}",
            }
        return {"url": url, "role": role, "status": r.status_code, "message": _message(r)}

    results = list(await asyncio.gather(*(one(role, url) for role, url in backends)))
    failed = [r for r in results if r["status"] != 200]
    if not failed:
        return JSONResponse({"backends": results}, status_code=200)
    status = max(r["status"] for r in failed)
    summary = "; ".join(f"{r['role']} {r['url']}: {r['status']} {r['message']}" for r in failed)
    done = len(results) - len(failed)
    error = {"message": f"{path}: {done} of {len(results)} backends succeeded; {summary}",
             "type": "BackendError", "param": None, "code": status}
    return JSONResponse({"error": error, "backends": results}, status_code=status)
