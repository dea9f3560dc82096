"""The system packages some tests need (scripts/system-packages.sh installs them as root): a test
whose package is missing skips with the command that installs it, except under CI=true, where it
fails (CI runs that script first, so a missing package there is a broken set-up, never a skip)."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import sysconfig
from collections.abc import Callable

import pytest

_PRESENT: dict[str, Callable[[], bool]] = {
    "g++": lambda: shutil.which(os.environ.get("CXX") or "c++") is not None,
    "python3-dev": lambda: os.path.isfile(
        os.path.join(sysconfig.get_paths()["include"], "Python.h")
    ),
    "redis-server": lambda: shutil.which("redis-server") is not None,
    "libibverbs1": lambda: ctypes.util.find_library("ibverbs") is not None,
    "iproute2": lambda: shutil.which("ip") is not None and shutil.which("tc") is not None,
    "prometheus": lambda: shutil.which("prometheus") is not None,
}


def in_ci() -> bool:
    """True under CI=true (or 1)."""
    return os.environ.get("CI", "").lower() in ("1", "true")


def missing(*packages: str) -> str | None:
    """Why the packages are not usable here (names them and the install command), or None."""
    gone = [p for p in packages if not _PRESENT[p]()]
    if not gone:
        return None
    return (f"system package(s) missing: {' '.join(gone)} (install: sudo apt-get install -y "
            f"{' '.join(gone)}, or run scripts/system-packages.sh as root)")


def require_reason(why: str | None) -> None:
    """Skip for `why` on a developer box; fail under CI. Nothing when `why` is None."""
    if why is None:
        return
    if in_ci():
        pytest.fail(f"CI must provide this: {why}")
    pytest.skip(why)


def require(*packages: str) -> None:
    """Skip (or under CI fail) the calling test unless every package is present."""
    require_reason(missing(*packages))
