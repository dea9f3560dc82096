"""Start and stop the servers a pool tier needs (redis-server; mooncake_master plus a store
process) as subprocesses bound to loopback (or to a pool host's address, run in its network
namespace), each with a readiness deadline.

The Mooncake master stores nothing itself, and a client's clean close drops the objects in its
segment, so `start_mooncake` also starts `pdkv.kvpool.mooncake_store_server`: a long-lived
process that holds the store's memory while engines (pure clients) come and go.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType

from pdkv.ports import free_port
from pdkv.router.pool_topology import MOONCAKE_SEGMENT_BYTES, POOL_TIERS, PoolServer

REDIS_INSTALL_HINT = "install it with `apt-get install -y redis-server`"
MOONCAKE_INSTALL_HINT = (
    "install it with `pip install mooncake-transfer-engine-non-cuda` "
    "and `apt-get install -y libibverbs1`"
)
_LOG_TAIL_BYTES = 2000


def _find_binary(name: str, hint: str) -> str:
    """`name` next to sys.executable (the venv's bin/) else on PATH. Raises RuntimeError."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found next to {sys.executable} nor on PATH: {hint}")
    return found


def _log_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _tcp_accepts(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _redis_ping(host: str, port: int, timeout_s: float) -> bool:
    """Whether a RESP PING on host:port answers +PONG within timeout_s (no client library)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class Service:
    """Subprocesses started for a pool tier, stopped together (in reverse start order).

    Attributes:
        name: "redis" or "mooncake".
        address: what the tier config takes: "redis://127.0.0.1:P/0" or "127.0.0.1:P" (master).
        procs: the processes, in start order.
        log_dir: directory holding one "<process>.log" (stdout+stderr) per process.
    """

    def __init__(
        self,
        name: str,
        address: str,
        procs: Sequence[subprocess.Popen[bytes]],
        log_dir: Path,
        owns_log_dir: bool,
    ) -> None:
        self.name = name
        self.address = address
        self.procs = list(procs)
        self.log_dir = log_dir
        self._owns_log_dir = owns_log_dir
        self._lock = threading.Lock()

    @property
    def pids(self) -> list[int]:
        """Process ids, in start order."""
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        """Whether every process is still running."""
        return all(p.poll() is None for p in self.procs)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM each process (last started first), wait up to `timeout_s` seconds for each,
        then SIGKILL. Idempotent; removes the log directory when this service created it."""
        with self._lock:
            for p in reversed(self.procs):
                if p.poll() is None:
                    try:
                        p.send_signal(signal.SIGTERM)
                        p.wait(timeout=timeout_s)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(timeout=timeout_s)
            if self._owns_log_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)
                self._owns_log_dir = False

    def __enter__(self) -> Service:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Service({self.name!r}, address={self.address!r}, pids={self.pids})"


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env
        )


def _wait_ready(
    proc: subprocess.Popen[bytes],
    log: Path,
    ready: Callable[[], bool],
    what: str,
    timeout_s: float,
) -> None:
    """Poll `ready()` until true; RuntimeError (with the log tail) if the process exits or the
    deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with code {proc.returncode} before it was ready; log tail:\n"
                f"{_log_tail(log)}"
            )
        if ready():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout_s} s; log tail:\n{_log_tail(log)}")
        time.sleep(0.05)


def _make_log_dir(log_dir: str | None, prefix: str) -> tuple[Path, bool]:
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        return Path(log_dir), False
    return Path(tempfile.mkdtemp(prefix=prefix)), True


def redis_argv(binary: str, host: str, port: int) -> list[str]:
    """The redis-server command line of a pool tier: bound to `host`:`port`, no persistence.
    Bound to another address than loopback (a pool host that engines on other hosts use), its
    protected mode is off: redis would otherwise answer only loopback clients, as it has no
    password here (keep such a pool on a private network)."""
    argv = [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    if not _is_loopback(host):
        argv += ["--protected-mode", "no"]
    return argv


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def find_redis_server() -> str:
    """Path of redis-server (next to sys.executable, else on PATH).

    Raises:
        RuntimeError: not found (the message says how to install it).
    """
    return _find_binary("redis-server", REDIS_INSTALL_HINT)


def start_redis(
    port: int | None = None,
    host: str = "127.0.0.1",
    timeout_s: float = 10.0,
    log_dir: str | None = None,
    exec_prefix: Sequence[str] = (),
) -> Service:
    """Start `redis-server --port P --bind HOST --save '' --appendonly no` (no persistence).

    Args:
        port: TCP port; None picks a free one (retried on a lost race).
        host: bind address (loopback by default).
        timeout_s: seconds to wait until PING answers (from this process, at HOST:P).
        log_dir: where the server's log goes; None = a temporary directory removed by stop().
        exec_prefix: argv prefix the server runs under (`ip netns exec NS`: another host); it
            must exec the server (the process stopped is the one started).

    Returns:
        A Service whose address is "redis://HOST:P/0".

    Raises:
        RuntimeError: redis-server is missing, exits early or does not answer in time.
    """
    binary = _find_binary("redis-server", REDIS_INSTALL_HINT)
    logs, owns = _make_log_dir(log_dir, "pdkv-redis-")
    attempts = 1 if port is not None else 3
    for attempt in range(attempts):
        p = port if port is not None else free_port(host=host)
        log = logs / f"redis-{p}.log"
        cmd = [*exec_prefix, *redis_argv(binary, host, p)]
        proc = _spawn(cmd, log)
        try:
            _wait_ready(
                proc, log, partial(_redis_ping, host, p, 0.5), f"redis-server on {p}", timeout_s
            )
        except BaseException as e:  # a failed start or Ctrl-C: never leave redis-server behind
            Service("redis", "", [proc], logs, False).stop(1.0)
            if not isinstance(e, RuntimeError) or attempt + 1 == attempts:
                if owns:
                    shutil.rmtree(logs, ignore_errors=True)
                raise
            continue
        return Service("redis", f"redis://{host}:{p}/0", [proc], logs, owns)
    raise AssertionError("unreachable")


def find_mooncake_master() -> str:
    """Path of mooncake_master (next to sys.executable, else on PATH).

    Raises:
        RuntimeError: not found (the message says how to install it).
    """
    return _find_binary("mooncake_master", MOONCAKE_INSTALL_HINT)


def mooncake_unavailable() -> str | None:
    """Why Mooncake (its transfer engine, Store client and mooncake_master) cannot run here (the
    message says what to install), or None."""
    try:
        import mooncake.engine  # noqa: F401
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"the mooncake package cannot be imported ({e}): {MOONCAKE_INSTALL_HINT}"
    try:
        find_mooncake_master()
    except RuntimeError as e:
        return str(e)
    return None


def mooncake_master_argv(binary: str, host: str, port: int, metrics_port: int) -> list[str]:
    """The mooncake_master command line of a pool: RPC on `host`:`port`, Prometheus metrics on
    `host`:`metrics_port`, and no embedded HTTP metadata server (it would bind every interface;
    clients use P2PHANDSHAKE instead)."""
    return [binary, f"--rpc_address={host}", f"--rpc_port={port}", f"--metrics_host={host}",
            f"--metrics_port={metrics_port}", "--enable_http_metadata_server=false"]


def mooncake_store_argv(python: str, host: str, master: str, segment_bytes: int,
                        parent_pid: int = 0) -> list[str]:
    """The command line of the store process (`pdkv.kvpool.mooncake_store_server`) that mounts
    `segment_bytes` of memory into the store of the master at `master` ("HOST:PORT"), reached by
    peers at `host`; with `parent_pid`, it exits when that process is gone."""
    argv = [python, "-m", "pdkv.kvpool.mooncake_store_server", "--master", master,
            "--segment-bytes", str(segment_bytes), "--local-hostname", host]
    return argv + (["--parent-pid", str(parent_pid)] if parent_pid else [])


def start_mooncake(
    segment_bytes: int = 512 << 20,
    port: int | None = None,
    host: str = "127.0.0.1",
    timeout_s: float = 30.0,
    log_dir: str | None = None,
    metrics_port: int | None = None,
    exec_prefix: Sequence[str] = (),
) -> Service:
    """Start a Mooncake Store: `mooncake_master` (`mooncake_master_argv`: RPC on HOST:P, metrics
    on HOST, no embedded HTTP metadata server: clients use P2PHANDSHAKE) and one
    `pdkv.kvpool.mooncake_store_server` process contributing `segment_bytes` of memory.

    Args:
        segment_bytes: bytes of memory the store process mounts (the pool's capacity).
        port: master RPC port; None picks a free one.
        host: address everything binds to and the store process is reached at (loopback by
            default; a pool host's address for engines on other hosts).
        timeout_s: seconds to wait for the master's port and then for the store's "ready" line.
        log_dir: where logs go; None = a temporary directory removed by stop().
        metrics_port: the master's metrics port; None picks a free one (on this machine: give
            it when `host` is not one of this namespace's addresses).
        exec_prefix: argv prefix both processes run under (`ip netns exec NS`: another host);
            it must exec the process (the one stopped is the one started). The master is
            checked from this process at HOST:P.

    Returns:
        A Service whose address is the master's "HOST:P" (MooncakeTier's `master`).

    Raises:
        ValueError: segment_bytes not positive.
        RuntimeError: mooncake_master or the mooncake package is missing, or a process exits
            early or is not ready in time.
    """
    if segment_bytes <= 0:
        raise ValueError(f"segment_bytes must be > 0, got {segment_bytes}")
    binary = find_mooncake_master()
    logs, owns = _make_log_dir(log_dir, "pdkv-mooncake-")
    taken = set() if port is None else {port}
    p = port if port is not None else free_port(taken, host)
    metrics = metrics_port if metrics_port is not None else free_port(taken, host)
    master_log = logs / f"mooncake-master-{p}.log"
    master = _spawn([*exec_prefix, *mooncake_master_argv(binary, host, p, metrics)], master_log)
    procs = [master]
    try:
        _wait_ready(
            master,
            master_log,
            lambda: _tcp_accepts(host, p, 0.5),
            f"mooncake_master on {p}",
            timeout_s,
        )
        store_log = logs / f"mooncake-store-{p}.log"
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so `-m pdkv...` resolves this checkout
        env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH", "")) if x)
        store = _spawn([*exec_prefix, *mooncake_store_argv(
            sys.executable, host, f"{host}:{p}", segment_bytes, os.getpid())], store_log, env)
        procs.append(store)
        _wait_ready(
            store,
            store_log,
            lambda: _has_ready_line(store_log),
            "mooncake store process",
            timeout_s,
        )
    except BaseException:
        Service("mooncake", "", procs, logs, owns).stop(2.0)
        raise
    return Service("mooncake", f"{host}:{p}", procs, logs, owns)


def _has_ready_line(log: Path) -> bool:
    try:
        with open(log, "rb") as f:
            return any(line.strip() == b"ready" for line in f)
    except OSError:
        return False


def start_pool_server(tier: str, log_dir: str) -> PoolServer | None:
    """Start the server `tier` needs (None for dram and disk), logging under `log_dir`.

    Raises:
        ValueError: unknown tier.
        RuntimeError: the server's binary or package is missing (the message says what to
            install) or it did not become ready in time.
    """
    if tier not in POOL_TIERS:
        raise ValueError(f"unknown pool tier {tier!r}; known: {', '.join(POOL_TIERS)}")
    if tier in ("dram", "disk"):
        return None
    if tier == "redis":
        return start_redis(log_dir=log_dir)
    return start_mooncake(segment_bytes=MOONCAKE_SEGMENT_BYTES, log_dir=log_dir)
