"""`pdkv bench memory`: resident memory (RSS) of a default `pdkv serve` after one request, and of
the `pdkv up` launcher and a `pdkv proxy`, against the goals of issue 14 (serve <= 1.2 GB,
launcher and proxy <= 120 MB each).

Starts `pdkv up --mode colocated` (the launcher, which starts one `pdkv serve` with the engine
flags given after `--`; none = the defaults: SmolLM2, 1 GiB KV cache) and a `pdkv proxy` in front
of that engine, on free loopback ports; reads every process's RSS once all are healthy, sends one
completion through the proxy, reads them again, and stops everything. RSS is VmRSS of
/proc/<pid>/status (Linux), the engine's summed with its descendants' (tp > 1 worker processes);
MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass

import httpx

from pdkv.launch.topology import Child, Topology
from pdkv.ports import free_port

HOST = "127.0.0.1"
SERVE_GOAL_BYTES = 1_200_000_000
LIGHT_GOAL_BYTES = 120_000_000
PROMPT = "The three primary colours are"


@dataclass(frozen=True)
class Rss:
    """Resident memory of a process (and its descendants), bytes: total = anon + file + shmem."""

    total: int
    anon: int
    file: int
    shmem: int
    torch_loaded: bool

    def __add__(self, other: Rss) -> Rss:
        return Rss(self.total + other.total, self.anon + other.anon, self.file + other.file,
                   self.shmem + other.shmem, self.torch_loaded or other.torch_loaded)


def process_rss(pid: int) -> Rss:
    """VmRSS, RssAnon, RssFile and RssShmem of `pid` from /proc/<pid>/status, and whether a
    libtorch library is mapped (/proc/<pid>/maps).

    Raises:
        OSError: no such process, or no /proc (not Linux).
    """
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024  # kB
    with open(f"/proc/{pid}/maps") as f:
        torch_loaded = any("libtorch" in line for line in f)
    return Rss(fields.get("VmRSS", 0), fields.get("RssAnon", 0), fields.get("RssFile", 0),
               fields.get("RssShmem", 0), torch_loaded)


def parents() -> dict[int, int]:
    """pid -> parent pid of every live process, from /proc/*/stat."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the
        # last ')'.
        parent[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parent


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children first, then their children, ...)."""
    parent = parents()
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop(0)
        kids = sorted(c for c, pp in parent.items() if pp == p)
        found += kids
        frontier += kids
    return found


def tree_rss(pid: int) -> Rss:
    """RSS of `pid` plus its descendants' (those that exit while being read count 0)."""
    total = process_rss(pid)
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            total = total + process_rss(child)
    return total


def build_memory_topology(args: argparse.Namespace) -> Topology:
    """The launcher (`pdkv up`, healthy when the engine it starts is) and the proxy, in that
    order."""
    py = [sys.executable, "-m", "pdkv.cli"]
    taken: set[int] = set()
    engine_port, proxy_port = free_port(taken), free_port(taken)
    engine_url = f"http://{HOST}:{engine_port}"
    topo = Topology()
    topo.children.append(
        Child(
            "launcher",
            engine_url,
            py
            + [
                "up",
                "--mode",
                "colocated",
                "--model",
                args.model,
                "--port",
                str(engine_port),
                "--disable-log-requests",
                "--log-dir",
                os.path.join(args.log_dir, "up"),
                "--health-timeout",
                str(args.health_timeout),
                "--",
                *args.engine_args,
            ],
            dict(os.environ),
        )
    )
    topo.children.append(
        Child(
            "proxy",
            f"http://{HOST}:{proxy_port}",
            py
            + [
                "proxy",
                "--backends",
                engine_url,
                "--host",
                HOST,
                "--port",
                str(proxy_port),
                "--log-level",
                "warning",
            ],
            dict(os.environ),
        )
    )
    topo.endpoint = topo.children[1].url
    return topo


def engine_pid(topo: Topology) -> int:
    """The engine process: the launcher's only child.

    Raises:
        RuntimeError: the launcher has not exactly one child.
    """
    launcher = topo.children[0]
    assert launcher.proc is not None
    engines = [c for c, p in parents().items() if p == launcher.proc.pid]
    if len(engines) != 1:
        raise RuntimeError(f"expected one engine process under the launcher, found {engines}")
    return engines[0]


def measure(topo: Topology, engine: int, max_tokens: int) -> dict[str, tuple[Rss, Rss]]:
    """RSS of serve (pid `engine`), launcher and proxy (each: (all healthy, after one request)).

    Raises:
        RuntimeError: the request fails.
    """
    launcher, proxy = topo.children
    assert launcher.proc is not None and proxy.proc is not None
    pids = {"serve": engine, "launcher": launcher.proc.pid, "proxy": proxy.proc.pid}

    def snapshot() -> dict[str, Rss]:
        return {
            name: tree_rss(pid) if name == "serve" else process_rss(pid)
            for name, pid in pids.items()
        }

    before = snapshot()
    with httpx.Client(timeout=600.0) as client:
        model = client.get(topo.endpoint + "/v1/models").json()["data"][0]["id"]
        r = client.post(
            topo.endpoint + "/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0},
        )
        if r.status_code != 200:
            raise RuntimeError(f"request through the proxy failed: {r.status_code} {r.text[:300]}")
    after = snapshot()
    return {name: (before[name], after[name]) for name in pids}


def report(results: dict[str, tuple[Rss, Rss]], engine_args: list[str]) -> str:
    """The table: RSS after start and after one request, its parts, torch loaded, goal met."""
    goals = {"serve": SERVE_GOAL_BYTES, "launcher": LIGHT_GOAL_BYTES, "proxy": LIGHT_GOAL_BYTES}
    labels = {
        "serve": "pdkv serve (engine)",
        "launcher": "pdkv up (launcher)",
        "proxy": "pdkv proxy",
    }
    mb = 1e6
    lines = [f"engine flags: {' '.join(engine_args) or '(defaults)'}; RSS in MB (10^6 bytes)",
             f"{'process':<22}{'started':>9}{'1 request':>11}{'anon':>8}{'file':>8}{'shmem':>8}"
             f"{'torch':>7}{'goal':>7}  met"]
    for name, (start, done) in results.items():
        lines.append(
            f"{labels[name]:<22}{start.total / mb:>9.0f}{done.total / mb:>11.0f}"
            f"{done.anon / mb:>8.0f}{done.file / mb:>8.0f}{done.shmem / mb:>8.0f}"
            f"{'yes' if done.torch_loaded else 'no':>7}"
            f"{goals[name] / mb:>7.0f}  {'yes' if done.total <= goals[name] else 'NO'}"
        )
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv bench memory` flags to `parser`."""
    parser.add_argument("--model", default="smollm2", help="model of the engine")
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="tokens the one request generates"
    )
    parser.add_argument(
        "--log-dir", default="pdkv-logs/bench-memory", help="one log file per process"
    )
    parser.add_argument(
        "--health-timeout", type=float, default=600.0, help="seconds to wait for start-up"
    )
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="after --: engine flags (default none: a default `pdkv serve`)")
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the measurement and print the table; 2 when the processes do not start."""
    args.engine_args = [a for a in args.engine_args if a != "--"]
    topo = build_memory_topology(args)
    engine = None
    try:
        if not topo.start_healthy(args.log_dir, args.health_timeout):
            return 2
        engine = engine_pid(topo)
        results = measure(topo, engine, args.max_tokens)
    finally:
        topo.stop()
        if engine is not None:
            _stop_orphan(engine)
    print(report(results, args.engine_args), flush=True)
    return 0


def _stop_orphan(pid: int, timeout: float = 15.0) -> None:
    """SIGKILL the engine `pid` if it outlived its launcher (killed before it stopped the engine)
    by more than `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
