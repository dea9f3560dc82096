"""Servers for the remote pool tiers (one per test session, loopback, free ports) and a helper
that runs pool code in a separate Python process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from system_packages import require_reason

from pdkv.launch import services

REPO_ROOT = Path(__file__).resolve().parents[2]


def redis_missing() -> str | None:
    """Why the redis tests cannot run here, or None."""
    try:
        import redis  # noqa: F401
    except ImportError as e:
        return f"redis client package missing ({e})"
    try:
        services._find_binary("redis-server", services.REDIS_INSTALL_HINT)
    except RuntimeError as e:
        return str(e)
    return None


def mooncake_missing() -> str | None:
    """Why the mooncake tests cannot run here, or None."""
    from pdkv.kvpool.tiers.mooncake import import_store_class

    try:
        import_store_class()
        services._find_binary("mooncake_master", services.MOONCAKE_INSTALL_HINT)
    except (ImportError, RuntimeError) as e:
        return str(e)
    return None


def _require(why: str | None) -> None:
    """Skip a test whose server is genuinely missing on a developer box; in CI (CI=true), which
    installs redis-server and libibverbs1 (scripts/system-packages.sh), a missing server is a
    failure, never a silent skip."""
    require_reason(why)


@pytest.fixture(scope="session")
def redis_service() -> Iterator[services.Service]:
    """A redis-server on a free loopback port for the whole session."""
    _require(redis_missing())
    with services.start_redis() as svc:
        yield svc


@pytest.fixture(scope="session")
def mooncake_service() -> Iterator[services.Service]:
    """mooncake_master + a 256 MiB store process on free loopback ports for the session."""
    _require(mooncake_missing())
    with services.start_mooncake(segment_bytes=256 << 20) as svc:
        yield svc


@pytest.fixture
def own_redis() -> Iterator[services.Service]:
    """A redis-server of this test's own (for tests that kill it)."""
    _require(redis_missing())
    with services.start_redis() as svc:
        yield svc


@pytest.fixture
def own_mooncake() -> Iterator[services.Service]:
    """A 64 MiB Mooncake Store of this test's own (for tests that kill it)."""
    _require(mooncake_missing())
    with services.start_mooncake(segment_bytes=64 << 20) as svc:
        yield svc


@pytest.fixture
def run_python() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run a Python snippet in a fresh interpreter (this checkout on PYTHONPATH) with the given
    PYTHONHASHSEED; fails the test when it exits non-zero."""

    def run(code: str, hash_seed: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            x for x in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if x
        )
        env["PYTHONHASHSEED"] = hash_seed
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        return proc

    return run
