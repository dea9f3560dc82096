"""The processes of a `pdkv up` run: each child's command, URL and log, started together, checked
for health with a deadline, watched until one dies or the user stops the run, and stopped (process
groups: SIGTERM, SIGKILL after a deadline), with the pool servers started before them stopped
after them. `pdkv up --mode ...` (launcher.py) and `pdkv up --deploy` (deploy_run.py) build one."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from pdkv.router.pool_topology import PoolServer


def engine_world_size(engine_args: Sequence[str]) -> int:
    """Worker ranks of an engine started with `engine_args`: its TP size (`--tensor-parallel-size
    N` / `-tp N`, default 1; DCP ranks are TP ranks, as in vLLM)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    known, _ = parser.parse_known_args([a for a in engine_args if a != "--"])
    return max(1, int(known.tensor_parallel_size))


@dataclass
class Child:
    """One process of the topology: `role` says what it does (prefill / decode / colocated
    engine / proxy), `threads` its torch CPU threads (0: not an engine)."""

    name: str
    url: str
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""
    role: str = ""
    threads: int = 0

    def describe(self) -> str:
        """One line for `pdkv up`'s listing: name, role, URL, threads, log file."""
        threads = (
            f"{self.threads} thread{'s' if self.threads != 1 else ''}" if self.threads else "-"
        )
        return (f"{self.name}: {self.role}, {self.url or '-'}, {threads}, "
                f"log {self.log_path or '-'}")


@dataclass
class Topology:
    """Processes to start; `endpoint` is what clients talk to; `services` are servers started
    before the children (a pool tier's), stopped after them."""

    children: list[Child] = field(default_factory=list)
    endpoint: str = ""
    services: list[PoolServer] = field(default_factory=list)

    def start(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        for c in self.children:
            c.log_path = os.path.join(log_dir, f"{c.name}.log")
            log = open(c.log_path, "wb")  # noqa: SIM115 - owned by the child process
            c.proc = subprocess.Popen(c.cmd, stdout=log, stderr=subprocess.STDOUT, env=c.env,
                                      start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        """Raises RuntimeError when a child dies or is not healthy in time (names it + its log)."""
        deadline = time.monotonic() + timeout
        pending = list(self.children)
        while pending:
            for c in list(pending):
                assert c.proc is not None
                if c.proc.poll() is not None:
                    raise RuntimeError(
                        f"{c.name} exited with {c.proc.returncode}; see {c.log_path}"
                    )
                if not c.url:  # no HTTP server (a headless node): its engine's health says
                    pending.remove(c)
                    continue
                try:
                    if httpx.get(c.url + "/health", timeout=2.0).status_code == 200:
                        pending.remove(c)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"not healthy after {timeout:.0f} s: {[c.name for c in pending]}"
                )
            if pending:
                time.sleep(0.5)

    def start_healthy(self, log_dir: str, timeout: float) -> bool:
        """Start every child and wait until all are healthy. On failure print why (and the last
        lines of each dead child's log) to stderr and return False; the caller still stops the
        rest with stop()."""
        self.start(log_dir)
        try:
            self.wait_healthy(timeout)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            for c in self.children:
                if c.proc is not None and c.proc.poll() is not None:
                    print(f"--- last lines of {c.log_path}:\n{_tail(c.log_path)}", file=sys.stderr)
            return False
        return True

    def dead_child(self) -> Child | None:
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                return c
        return None

    def dead_service(self) -> PoolServer | None:
        return next((s for s in self.services if not s.alive()), None)

    def stop(self) -> None:
        """Stop the children (SIGTERM to each process group, SIGKILL after 15 s), then the
        services (each with its own deadline)."""
        try:
            self._stop_children()
        finally:
            for svc in reversed(self.services):
                svc.stop(5.0)

    def _stop_children(self) -> None:
        for c in reversed(self.children):
            if c.proc is not None and c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait(5)


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def supervise(topo: Topology, log_dir: str, health_timeout: float,
              on_ready: Callable[[Topology], int] | None = None) -> int:
    """Start `topo`'s children, wait until every one is healthy (`health_timeout` seconds), list
    them and the endpoint, then run `on_ready(topo)` and return its code, or (no `on_ready`)
    watch until a child or service dies (returns 1). Returns 1 when the start fails. Ctrl-C /
    SIGTERM arrive as KeyboardInterrupt (the caller's handler); the caller stops `topo`."""
    print(f"starting {len(topo.children)} processes: {[c.name for c in topo.children]} "
          f"(logs in {log_dir}/)", flush=True)
    if not topo.start_healthy(log_dir, health_timeout):
        return 1
    for c in topo.children:
        print(f"  {c.describe()}", flush=True)
    print(f"ready: {topo.endpoint}  (OpenAI API at {topo.endpoint}/v1)", flush=True)
    if on_ready is not None:
        return on_ready(topo)
    while True:
        dead = topo.dead_child()
        if dead is not None:
            print(
                f"{dead.name} exited ({dead.proc.returncode if dead.proc else '?'}); stopping "
                f"all; see {dead.log_path}",
                file=sys.stderr,
            )
            return 1
        dead_svc = topo.dead_service()
        if dead_svc is not None:
            print(f"pool server {dead_svc.address} exited; stopping all", file=sys.stderr)
            return 1
        time.sleep(0.5)


def stop_on_signals() -> None:
    """SIGTERM and SIGINT (also when started in the background) raise KeyboardInterrupt in the
    main thread, so a `finally` stops everything."""

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
