"""Redis tier: chunks as raw-bytes string values on a redis-server (shared across processes).

Protocol: one `SET key value [EX ttl]` per put, `GET` per get, one pipeline of `EXISTS` per
`contains_many`, `DEL` per remove (redis-py 8, RESP2, no client-side retries). Every socket
operation and connect is bounded by `timeout_s`, so a killed server costs one fast `TierError`.

Bytes in use: the bytes of the values this instance put that the server still holds. The tier
remembers each key it put with its size (dropped on `remove` and on a `get` miss) and, in the
background at most every `BYTES_IN_USE_MAX_AGE_S` seconds, asks which still exist (one pipeline
of EXISTS) and forgets the rest (expired, evicted by redis's maxmemory policy, removed by
another client); `bytes_in_use` never waits for that. Instances sharing the server each report
their own writes, so the pool's total is about their sum (a chunk two instances both put
counts twice). `INFO memory`'s used_memory_dataset was not used: it counts the server's
allocations, not values (a 3 MiB value takes 3.5 MiB, and a connection's query buffer moves in
and out of it), so it is noisy for a pool of a few chunks, and it counts whatever else the
server keeps.

KV events (`Tier.set_event_listener`, issue 34): only what this instance does or sees is
reported. A put of this instance reports its key stored; its `remove`, a `get` miss on a key it
put, and the background check above finding such a key gone report it removed. A drop by redis
itself (TTL expiry, maxmemory eviction) or by another client's DEL is not seen when it happens:
it is reported at the next miss or background check (at most `BYTES_IN_USE_MAX_AGE_S` seconds
later while the store's stats are read every step), and never for keys this instance did not
put.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pdkv.kvpool.tiers.base import BackgroundValue, OwnEntries, Tier, TierError

_T = TypeVar("_T")

BYTES_IN_USE_MAX_AGE_S = 5.0
"""Seconds between background checks of which of this instance's entries the server holds."""


class RedisTier(Tier):
    """A pool tier on a redis-server reached through `url`.

    Args:
        url: "redis://HOST:PORT/DB" (also rediss:// and unix://, as redis-py accepts).
        ttl_s: expire entries this many seconds after their put (rounded up to whole
            seconds, at least 1); None keeps them until redis evicts them (maxmemory policy).
        timeout_s: socket connect and read/write timeout in seconds for every call.

    Raises:
        ValueError: bad url, ttl_s or timeout_s.

    Thread-safe: redis-py's connection pool hands each thread its own connection. No round trip
    happens at construction; the first call to a dead server raises `TierError`.
    """

    name = "redis"
    local_index = False

    def __init__(self, url: str, ttl_s: float | None = None, timeout_s: float = 1.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"redis url must start with redis://, rediss:// or unix://, got {url!r}"
            )
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._url = url
        self._ex = None if ttl_s is None else max(1, math.ceil(ttl_s))
        self._redis_mod = redis
        # retries=0: a refused connection or a timeout surfaces at once (redis-py 6+ retries 3
        # times with exponential backoff by default, which would turn a dead server into a stall).
        self._client: Any = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=False,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._own = OwnEntries(self)
        self._in_use = BackgroundValue(
            self.fetch_bytes_in_use, BYTES_IN_USE_MAX_AGE_S, "pdkv-redis-in-use"
        )

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        exc = self._redis_mod.exceptions
        try:
            return fn()
        except exc.TimeoutError as e:
            raise TierError(f"redis {what} at {self._url} timed out: {e}", "timeout") from e
        except exc.ConnectionError as e:
            raise TierError(f"redis {what} at {self._url} unavailable: {e}", "unavailable") from e
        except exc.OutOfMemoryError as e:  # "-OOM ...": redis-py strips the code from the text
            raise TierError(f"redis {what} at {self._url} is full: {e}", "full") from e
        except exc.RedisError as e:
            raise TierError(f"redis {what} at {self._url} failed: {e}", "other") from e
        except TimeoutError as e:  # socket.timeout outside redis-py's own wrapping
            raise TierError(f"redis {what} at {self._url} timed out: {e}", "timeout") from e
        except OSError as e:
            raise TierError(f"redis {what} at {self._url} unavailable: {e}", "unavailable") from e

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One pipelined round trip of EXISTS per key (no MULTI). Raises TierError."""
        if not keys:
            return []

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return list(pipe.execute())

        return [bool(n) for n in self._call("EXISTS", run)]

    def get(self, key: str) -> bytes | None:
        """GET; None on a miss (absent or expired). Raises TierError."""
        value = self._call("GET", lambda: self._client.get(key))
        if value is None:
            self._own.drop(key)
            return None
        return bytes(value)

    def put(self, key: str, value: bytes) -> None:
        """SET (with EX when a ttl is set). Raises TierError ("full" when redis answers OOM:
        maxmemory reached under a noeviction policy)."""
        self._call("SET", lambda: self._client.set(key, value, ex=self._ex))
        self._own.add(key, len(value))

    def remove(self, key: str) -> None:
        """DEL. Raises TierError when the server cannot answer."""
        self._call("DEL", lambda: self._client.delete(key))
        self._own.drop(key)

    def bytes_in_use(self) -> int:
        """Bytes of this instance's entries the server held at the last background check (see
        the module docstring; 0 until the first check answers, a failed check keeps the previous
        figure). Never blocks."""
        return self._in_use.get()

    def fetch_bytes_in_use(self) -> int:
        """Check now which entries this instance put the server still holds (one pipeline of
        EXISTS), forget the others, and return the bytes of those it holds.

        Raises:
            TierError: the server cannot answer (nothing is forgotten then).
        """
        keys = self._own.keys()
        return self._own.prune(keys, self.contains_many(keys))

    def close(self) -> None:
        """Close the connection pool (no round trip)."""
        with contextlib.suppress(Exception):  # sockets of a dead server: nothing to release
            self._client.close()
