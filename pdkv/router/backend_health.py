"""Per-backend health in the proxy: each engine is healthy or not, from a periodic probe of its
GET /health (`HealthCheckConfig`) and from the proxy's own failed legs (a refused connection or
a timeout marks the engine unhealthy until a probe succeeds). Routing skips unhealthy engines;
when none of a pool is healthy, the proxy probes them before answering 503 (so an engine that
restarted is used at once). The proxy's /health reports each one (`BackendHealth.report`); the
gauge `pdkv:proxy_backend_healthy{backend, role}` follows the state."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TypedDict

import httpx
from prometheus_client import Gauge

from pdkv.router.policies import Backend

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
DEFAULT_TIMEOUT_S = 5.0

DOWN_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout, httpx.WriteTimeout)
"""A leg's failures that mark its engine unhealthy: it refused the connection or did not answer
in time. (A PoolTimeout is the proxy's own connection limit, not the engine's fault.)"""


@dataclass(frozen=True)
class HealthCheckConfig:
    """The proxy's probes of its engines (flags `--health-check-interval-secs`,
    `--health-check-timeout-secs`, as SGLang's router names them).

    Attributes:
        interval_s: seconds between two probes of every engine's GET /health.
        timeout_s: seconds one probe may take; a slower or failed answer marks the engine
            unhealthy.
    Raises:
        ValueError: a value that is not > 0.
    """

    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"health check interval must be > 0 s, got {self.interval_s}")
        if not self.timeout_s > 0:
            raise ValueError(f"health check timeout must be > 0 s, got {self.timeout_s}")


class BackendState(TypedDict):
    """One engine's entry in the proxy's /health answer (`error`: why it is unhealthy, None when
    healthy; `checked_s_ago`: seconds since its last probe, None before the first)."""

    url: str
    role: str
    healthy: bool
    error: str | None
    checked_s_ago: float | None


@dataclass
class _State:
    healthy: bool = True  # routable until a probe or a leg says otherwise
    error: str | None = None
    checked_at: float | None = None
    seen_up: bool = False  # a probe has succeeded once (before that, down is start-up)


class BackendHealth:
    """The health of every engine behind one proxy, keyed by URL. Used from the proxy's event
    loop only.

    Args:
        roles: (role, backend) of every engine: "prefill", "decode" or "backend" (colocated).
        config: probe interval and timeout.
        gauge: pdkv:proxy_backend_healthy (labels backend, role), set on every change.
    """

    def __init__(
        self, roles: list[tuple[str, Backend]], config: HealthCheckConfig, gauge: Gauge
    ) -> None:
        self.config = config
        self._roles = roles
        self._gauge = gauge
        self._states = {b.url: _State() for _, b in roles}
        for role, b in roles:
            gauge.labels(b.url, role).set(1)

    def is_healthy(self, url: str) -> bool:
        """Whether `url` is routable (an unknown URL is)."""
        state = self._states.get(url)
        return state is None or state.healthy

    def healthy(self, pool: list[Backend]) -> list[Backend]:
        """The routable backends of `pool`, in order."""
        return [b for b in pool if self.is_healthy(b.url)]

    def why_down(self, pool: list[Backend]) -> str:
        """'URL: reason; ...' for the unhealthy backends of `pool`."""
        return "; ".join(
            f"{b.url}: {self._states[b.url].error}" for b in pool if not self.is_healthy(b.url)
        )

    def _set(self, url: str, healthy: bool, error: str | None) -> None:
        state = self._states.get(url)
        if state is None:
            return
        if state.healthy != healthy:
            if healthy:
                logger.info("backend %s is %s", url, "healthy again" if state.seen_up else "up")
            elif state.seen_up:
                logger.warning("backend %s is unhealthy: %s", url, error)
            else:  # an engine still starting (the proxy is often up first): not a fault yet
                logger.info("backend %s is not up yet: %s", url, error)
        state.seen_up = state.seen_up or healthy and error is None
        state.healthy, state.error = healthy, error
        for role, b in self._roles:
            if b.url == url:
                self._gauge.labels(url, role).set(1 if healthy else 0)

    def leg_failed(self, url: str, error: BaseException) -> None:
        """A leg to `url` failed with `error`: a refused connection or a timeout (DOWN_ERRORS)
        marks it unhealthy until a probe succeeds; other errors change nothing."""
        if isinstance(error, DOWN_ERRORS):
            self._set(url, False, f"leg failed: {type(error).__name__}: {error}")

    async def probe(self, client: httpx.AsyncClient, url: str) -> bool:
        """GET url/health within the configured timeout; records and returns whether it
        answered 200 (never raises for the engine's failures)."""
        try:
            r = await client.get(url + "/health", timeout=self.config.timeout_s)
            error = None if r.status_code == 200 else f"GET /health answered {r.status_code}"
        except httpx.HTTPError as e:
            error = f"GET /health failed: {type(e).__name__}: {e}"
        state = self._states.get(url)
        if state is not None:
            state.checked_at = time.monotonic()
        self._set(url, error is None, error)
        return error is None

    def report(self) -> list[BackendState]:
        """Every engine's state, in the order given (an engine in two roles appears twice)."""
        now = time.monotonic()
        out: list[BackendState] = []
        for role, b in self._roles:
            s = self._states[b.url]
            ago = None if s.checked_at is None else round(now - s.checked_at, 3)
            out.append({"url": b.url, "role": role, "healthy": s.healthy, "error": s.error,
                        "checked_s_ago": ago})
        return out
