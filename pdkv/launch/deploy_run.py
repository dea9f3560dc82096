"""`pdkv up --deploy FILE`: a deployment file's processes, started on this machine or printed
per host for real machines.

- `--print-commands`: per host of the file, the commands to run there (the pool service first,
  then the engines, then the proxy), with the file's addresses and ports; nothing starts.
- without `--netns`: every host is 127.0.0.1 and every listening port a free one (two hosts of
  the file may use one port number; here they share an address).
- with `--netns` (root): each host is a network namespace on one bridge with its own address
  and the file's ports, its link shaped as the file says (pdkv.launch.netns); every process runs
  under `ip netns exec`, binds its host's address and advertises it (the P2P connector's
  kv_host / kv_advertise_host); the proxy reaches P and D, and the engines the pool, at their
  hosts' addresses. The namespaces are removed on exit, on a failed start and on Ctrl-C /
  SIGTERM.

The pool service: redis-server, or mooncake_master plus the Mooncake Store process holding the
pool's memory (pdkv.kvpool.mooncake_store_server), both bound to the pool host's address; each
engine's mooncake tier is a pure client reached at its own host's address (`local_hostname`).

Under a kv_aware proxy every engine publishes its KV events at its host's address, where the
proxy (on any host) subscribes. `run_deployment` is the start-run-teardown that `pdkv up
--deploy` and `pdkv bench chaos --deploy` share.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pdkv.launch.deploy import Deployment, DeploymentError, Engine, listening_ports, load_deployment
from pdkv.launch.netns import NetnsBridge, unavailable_reason
from pdkv.launch.services import (
    Service,
    find_mooncake_master,
    find_redis_server,
    mooncake_master_argv,
    mooncake_store_argv,
    redis_argv,
    start_mooncake,
    start_redis,
)
from pdkv.launch.topology import Child, Topology, stop_on_signals, supervise
from pdkv.ports import free_port
from pdkv.router.policies import KV_EVENT_POLICIES
from pdkv.router.pool_topology import (
    DEFAULT_CHUNK_SIZE,
    PoolServer,
    pd_kv_transfer_config,
    pool_kv_transfer_config,
)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Placement:
    """Where one run of a deployment lives: each host's address, and the port each of the
    file's listening ports becomes ((host, port in the file) → port; absent: unchanged)."""

    addresses: Mapping[str, str]
    ports: Mapping[tuple[str, int], int]

    def port(self, host: str, port: int) -> int:
        """The port `port` of the file's `host` listens on here (0 stays 0: system-chosen)."""
        return self.ports.get((host, port), port) if port else 0

    def url(self, host: str, port: int) -> str:
        """http://address:port of the file's `host`:`port`."""
        return f"http://{self.addresses[host]}:{self.port(host, port)}"


def as_written(dep: Deployment) -> Placement:
    """The file's own addresses and ports (real machines, `--print-commands`)."""
    return Placement({h.name: h.address for h in dep.hosts}, {})


def on_loopback(dep: Deployment) -> Placement:
    """Every host at 127.0.0.1, every listening port a distinct free one (a TP engine's
    per-rank ports stay consecutive)."""
    taken: set[int] = set()
    ports: dict[tuple[str, int], int] = {}
    for _key, host, first, count in listening_ports(dep):
        base = free_port(taken, count=count)
        for r in range(count):
            ports[(host, first + r)] = base + r
    return Placement({h.name: LOOPBACK for h in dep.hosts}, ports)


def in_namespaces(dep: Deployment, bridge: NetnsBridge) -> Placement:
    """Each host at its namespace's address, with the file's ports."""
    return Placement({h.name: bridge.address(h.name) for h in dep.hosts}, {})


@dataclass(frozen=True)
class Process:
    """One process of a deployment: `name` ("prefill0", "proxy", "pool"), `role` (for the
    listing), the file's `host` it runs on, its `argv`, and the URL answering GET /health
    ("" for the pool service, checked by its own protocol)."""

    name: str
    role: str
    host: str
    argv: tuple[str, ...]
    url: str


def pool_config(dep: Deployment, place: Placement, engine: Engine) -> str | None:
    """`engine`'s KVPoolConnector JSON for the deployment's pool, or None without one: a redis
    tier at the pool host's address, or a mooncake tier whose master is there and whose client
    is reached at the engine's own host's address."""
    if dep.pool is None:
        return None
    address = f"{place.addresses[dep.pool.host]}:{place.port(dep.pool.host, dep.pool.port)}"
    if dep.pool.service == "mooncake":
        spec = {"name": "mooncake", "master": address,
                "local_hostname": place.addresses[engine.host]}
    else:
        spec = {"name": "redis", "url": f"redis://{address}/0"}
    return pool_kv_transfer_config(spec, dep.pool.chunk_size)


def engine_kv_config(dep: Deployment, engine: Engine, place: Placement,
                     engine_id: str | None = None) -> dict[str, object]:
    """An engine's --kv-transfer-config: P2PConnector bound to and advertising its host's
    address (kv_host, kv_advertise_host), with the pool's MultiConnector when there is one;
    `engine_id`: the connector's engine_id (None: a random one per start)."""
    address = place.addresses[engine.host]
    extra: dict[str, object] = {"transfer": dep.kv_transfer, "kv_host": address,
                                "kv_advertise_host": address}
    if dep.transfer_mode != "pull":  # (pull: the connector's default, left out)
        extra["transfer_mode"] = dep.transfer_mode
    for key, value in (("kv_lease_duration", dep.kv_lease_duration),
                       ("transfer_timeout", dep.transfer_timeout)):
        if value is not None:
            extra[key] = value
    if engine.role == "prefill":
        for key, port in (("kv_port", engine.kv_port), ("transfer_port", engine.transfer_port)):
            if port:
                extra[key] = place.port(engine.host, port)
    role = "kv_producer" if engine.role == "prefill" else "kv_consumer"
    cfg = pd_kv_transfer_config(role, extra, dep.kv_load_failure_policy,
                                pool_config(dep, place, engine))
    if engine_id is not None:
        cfg["engine_id"] = engine_id
    return cfg


def kv_events_config(engine: Engine, place: Placement) -> dict[str, object]:
    """An engine's --kv-events-config under a kv_aware proxy: its PUB socket bound to its
    host's address at `kv_events_port` and the replay socket at the next port (0: ports the
    system picks; the proxy reads them from the engine's GET /kv_events). The proxy on another
    host subscribes there (pdkv.router.kv_subscriber)."""
    address = place.addresses[engine.host]
    port = place.port(engine.host, engine.kv_events_port)
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://{address}:{port}",
            "replay_endpoint": f"tcp://{address}:{port + 1 if port else 0}"}


def node_flags(engine: Engine, place: Placement) -> list[str]:
    """vLLM's multi-node flags of an engine whose ranks span hosts, without --node-rank
    (--nnodes, --master-addr: its host's address, --master-port); [] on one host."""
    if not engine.worker_hosts:
        return []
    return ["--nnodes", str(engine.nnodes), "--master-addr", place.addresses[engine.host],
            "--master-port", str(place.port(engine.host, engine.master_port))]


def pool_processes(dep: Deployment, place: Placement, pool_server: str | None = None,
                   python: str = "python") -> list[Process]:
    """The pool service's processes in start order ([] without a pool): "pool" (the server
    binary `pool_server`, default its name: redis-server or mooncake_master), then for mooncake
    "pool-store" (the store process holding the pool's memory, run by `python`)."""
    pool = dep.pool
    if pool is None:
        return []
    host, port = place.addresses[pool.host], place.port(pool.host, pool.port)
    if pool.service == "redis":
        return [Process("pool", "pool (redis)", pool.host,
                        tuple(redis_argv(pool_server or "redis-server", host, port)), "")]
    metrics = place.port(pool.host, pool.port + 1)
    master = mooncake_master_argv(pool_server or "mooncake_master", host, port, metrics)
    return [Process("pool", "pool (mooncake_master)", pool.host, tuple(master), ""),
            Process("pool-store", f"pool (Mooncake Store, {pool.segment_bytes} bytes)",
                    pool.host, tuple(mooncake_store_argv(python, host, f"{host}:{port}",
                                                         pool.segment_bytes)), "")]


def processes(dep: Deployment, place: Placement, pdkv: Sequence[str], pool_server: str | None,
              extra_engine_flags: Sequence[str] = (), python: str = "python",
              engine_ids: Mapping[str, str] | None = None) -> list[Process]:
    """The deployment's processes in start order: the pool service (`pool_processes`), the
    engines (prefill first; an engine whose ranks span hosts followed by one headless process
    per worker host, url ""), the proxy. `pdkv` is the argv that runs the pdkv CLI,
    `pool_server` the pool server's binary (None: its name), `python` the interpreter of the
    Mooncake Store process, `extra_engine_flags` go last on every engine, `engine_ids` (engine
    name → id) fix the KV connector's engine_id of the engines it names. Under a kv_aware proxy
    every engine publishes its KV events at its host's address (`kv_events_config`)."""
    ids = engine_ids or {}
    events = dep.proxy.routing in KV_EVENT_POLICIES
    out = pool_processes(dep, place, pool_server, python)
    for e in dep.engines:
        address = place.addresses[e.host]
        nodes = node_flags(e, place)
        argv = [*pdkv, "serve", "--model", dep.model, *dep.engine_args, *e.args,
                "--host", address, "--port", str(place.port(e.host, e.port)),
                "--kv-transfer-config", json.dumps(engine_kv_config(dep, e, place,
                                                                    ids.get(e.name))),
                *(["--kv-events-config", json.dumps(kv_events_config(e, place))]
                  if events else []),
                *(nodes + ["--node-rank", "0"] if nodes else []), *extra_engine_flags]
        what = "prefill (kv_producer)" if e.role == "prefill" else "decode (kv_consumer)"
        if nodes:
            what += f", node 0 of {e.nnodes}"
        out.append(Process(e.name, what + (", pool" if dep.pool else ""), e.host, tuple(argv),
                           place.url(e.host, e.port)))
        for n, host in enumerate(e.worker_hosts, 1):
            argv = [*pdkv, "serve", "--model", dep.model, *dep.engine_args, *e.args, *nodes,
                    "--node-rank", str(n), "--headless", *extra_engine_flags]
            out.append(Process(f"{e.name}-node{n}", f"{e.role} ranks of node {n} of {e.nnodes} "
                               f"(headless, leader {e.name})", host, tuple(argv), ""))
    px = dep.proxy
    argv = [*pdkv, "proxy",
            "--prefill", ",".join(place.url(e.host, e.port) for e in dep.prefill),
            "--decode", ",".join(place.url(e.host, e.port) for e in dep.decode),
            "--host", place.addresses[px.host], "--port", str(place.port(px.host, px.port)),
            "--routing", px.routing, "--tokenizer", dep.model]
    for flag, value in (("--timeout", px.timeout),
                        ("--health-check-interval-secs", px.health_check_interval)):
        if value is not None:
            argv += [flag, f"{value:g}"]
    out.append(Process("proxy", f"proxy (P/D, {px.routing})", px.host, tuple(argv),
                       place.url(px.host, px.port)))
    return out


def format_commands(dep: Deployment) -> str:
    """Per host, the commands to run there, hosts in the order to start them (read top to
    bottom): the pool service's host first (the engines connect to it at start-up), then the
    engines' hosts, then the proxy's (hosts running nothing last; ties in the file's order)."""
    procs = processes(dep, as_written(dep), ["pdkv"], None)
    order = (("the pool first, then " if dep.pool else "") + "the engines (an engine's headless "
             "nodes in any order beside it), then the proxy")
    lines = [f"# {dep.source}: {len(procs)} processes on {len(dep.hosts)} hosts; start {order} "
             "(hosts below in that order)", ""]
    first = {h.name: min((i for i, p in enumerate(procs) if p.host == h.name),
                         default=len(procs)) for h in dep.hosts}
    for h in sorted(dep.hosts, key=lambda h: first[h.name]):  # (sorted is stable)
        mine = [p for p in procs if p.host == h.name]
        shaped = ", ".join(f"{k} {v}" for k, v in (("rate", h.link.rate),
                                                  ("delay", h.link.delay)) if v)
        lines.append(f"# host {h.name} ({h.address})" + (f", link {shaped}" if shaped else ""))
        if not mine:
            lines.append("#   (no process)")
        for p in mine:
            lines.append(f"# {p.name}: {p.role}" + (f", {p.url}" if p.url else ""))
            lines.append(shlex.join(p.argv))
        lines.append("")
    endpoint = as_written(dep).url(dep.proxy.host, dep.proxy.port)
    lines.append(f"# endpoint: {endpoint} (OpenAI API at {endpoint}/v1)")
    return "\n".join(lines)


def check_deploy_args(args: argparse.Namespace) -> None:
    """Raises ValueError for a `pdkv up` flag that `--deploy` takes from the file instead, or
    `--netns` / `--print-commands` used wrongly."""
    if getattr(args, "deploy", None) is None:
        for flag in ("netns", "print_commands"):
            if getattr(args, flag, False):
                raise ValueError(f"--{flag.replace('_', '-')} needs --deploy FILE")
        return
    fixed = {"mode": "pd", "num_prefill": 1, "num_decode": 1, "num_instances": 1, "pool": None,
             "skip_prefill_on_pool_hit": False, "port": 0, "model": "smollm2",
             "routing": "round_robin", "kv_transfer": "tcp", "transfer_mode": "pull",
             "kv_load_failure_policy": "fail", "pool_chunk_size": DEFAULT_CHUNK_SIZE}
    for name, default in fixed.items():
        if getattr(args, name, default) != default:
            raise ValueError(f"--deploy takes the topology from the file: leave out "
                             f"--{name.replace('_', '-')} (the file's keys: model, engine_args, "
                             "kv_transfer, transfer_mode, kv_load_failure_policy, "
                             "kv_lease_duration, transfer_timeout, [[prefill]], [[decode]], "
                             "[proxy], [pool] with its chunk_size)")
    if [a for a in args.engine_args if a != "--"]:
        raise ValueError("--deploy takes the engine flags from the file (engine_args, or args "
                         "of one engine): leave out the flags after --")
    if args.netns and args.print_commands:
        raise ValueError("--print-commands prints the commands for the file's hosts and starts "
                         "nothing: leave out --netns")


def _children(procs: Sequence[Process], prefix: Mapping[str, Sequence[str]],
              env: dict[str, str]) -> list[Child]:
    engines = [p for p in procs if p.name.startswith(("prefill", "decode"))]
    threads = int(env["PDKV_NUM_THREADS"])
    out = []
    for p in procs:
        if p.name.startswith("pool"):  # started before them (start_pool)
            continue
        is_engine = p in engines
        out.append(Child(p.name, p.url, [*prefix.get(p.host, ()), *p.argv],
                         env if is_engine else dict(os.environ), role=f"{p.role} on {p.host}",
                         threads=threads if is_engine else 0))
    return out



def find_pool_binary(dep: Deployment) -> str | None:
    """The pool service's server binary (redis-server or mooncake_master; None without a
    pool).

    Raises:
        RuntimeError: it is not installed (the message says how to install it).
    """
    if dep.pool is None:
        return None
    return find_mooncake_master() if dep.pool.service == "mooncake" else find_redis_server()


def start_pool(dep: Deployment, place: Placement, prefix: Mapping[str, Sequence[str]],
               log_dir: str) -> Service:
    """Start the deployment's pool service on its host (its address and port in `place`, under
    `prefix[host]`: `ip netns exec`), logging under `log_dir`; ready when it returns (redis
    answers PING, the mooncake master accepts connections and its store process said "ready").

    Raises:
        RuntimeError: no pool, the server is missing, exits early or is not ready in time.
    """
    pool = dep.pool
    if pool is None:
        raise RuntimeError("the deployment has no [pool]")
    os.makedirs(log_dir, exist_ok=True)
    host, port = place.addresses[pool.host], place.port(pool.host, pool.port)
    exec_prefix = prefix.get(pool.host, ())
    if pool.service == "mooncake":
        return start_mooncake(segment_bytes=pool.segment_bytes, port=port, host=host,
                              log_dir=log_dir, metrics_port=place.port(pool.host, pool.port + 1),
                              exec_prefix=exec_prefix)
    return start_redis(port=port, host=host, log_dir=log_dir, exec_prefix=exec_prefix)


def main(args: argparse.Namespace) -> int:
    """`pdkv up --deploy FILE [--netns | --print-commands]`; returns the exit code (1 with a
    message on stderr for a bad file, a missing capability or a failed start)."""
    try:
        check_deploy_args(args)
        dep = load_deployment(args.deploy)
    except (ValueError, DeploymentError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_commands:
        print(format_commands(dep))
        return 0

    def demo(topo: Topology) -> int:
        from pdkv.launch.demo import run_demo

        run_demo(topo.endpoint, [c.url for c in topo.children
                                 if c.name.startswith("decode") and c.url], dep.model)
        return 0

    flags = ["--disable-log-requests"] if getattr(args, "disable_log_requests", False) else []
    return run_deployment(dep, netns=args.netns, log_dir=args.log_dir,
                          health_timeout=args.health_timeout,
                          threads_per_engine=args.threads_per_engine,
                          on_ready=demo if getattr(args, "demo", False) else None,
                          extra_engine_flags=flags)


def run_deployment(dep: Deployment, *, netns: bool, log_dir: str, health_timeout: float,
                   threads_per_engine: int = 0,
                   on_ready: Callable[[Topology], int] | None = None,
                   extra_engine_flags: Sequence[str] = (),
                   engine_ids: Mapping[str, str] | None = None,
                   interrupted: int = 0) -> int:
    """Start `dep` on this machine (in network namespaces when `netns`, else every host on
    127.0.0.1), wait until every process is healthy (`health_timeout` s), then run
    `on_ready(topo)` and return its code, or (None) watch until a process dies (1). Everything
    it started, namespaces included, is stopped and removed before it returns, also on a failed
    start and on Ctrl-C / SIGTERM (then returns `interrupted`).

    `threads_per_engine`: each engine's torch threads (0: cores / engines);
    `extra_engine_flags` go last on every engine; `engine_ids` fixes the KV connector's
    engine_id of the engines it names ("prefill0" → id; others get a random one per start).
    Returns 1 with a message on stderr when `--netns` cannot work here (not root, no ip / tc),
    the pool's server is missing or does not start, or a process fails to start.
    """
    if netns:
        reason = unavailable_reason()
        if reason:
            print(f"error: --netns {reason}", file=sys.stderr)
            return 1
    try:
        pool_binary = find_pool_binary(dep)
    except RuntimeError as e:
        print(f"error: the deployment's pool: {e}", file=sys.stderr)
        return 1
    stop_on_signals()
    bridge: NetnsBridge | None = None
    services: list[PoolServer] = []
    topo = Topology(services=services)
    try:
        if netns:
            bridge = NetnsBridge([h.name for h in dep.hosts],
                                 {h.name: h.link for h in dep.hosts})
            bridge.setup()
            place = in_namespaces(dep, bridge)
            prefix = {h.name: bridge.exec_prefix(h.name) for h in dep.hosts}
            print(f"namespaces of {bridge.run_name} on {bridge.subnet} (this machine: "
                  f"{bridge.root_address}):", flush=True)
            for h in dep.hosts:
                print(f"  {h.name}: {bridge.ns(h.name)} {bridge.address(h.name)}, link "
                      f"{bridge.link_text(h.name)}", flush=True)
        else:
            place = on_loopback(dep)
            prefix = {}
        n_engines = len(dep.engines)
        threads = threads_per_engine or max(1, (os.cpu_count() or 1) // n_engines)
        env = dict(os.environ, PDKV_NUM_THREADS=str(threads))
        procs = processes(dep, place, [sys.executable, "-m", "pdkv.cli"], pool_binary,
                          extra_engine_flags, sys.executable, engine_ids)
        if dep.pool is not None:
            try:
                server = start_pool(dep, place, prefix, log_dir)
            except RuntimeError as e:
                print(f"error: the deployment's pool: {e}", file=sys.stderr)
                return 1
            services.append(server)
            print(f"pool: {dep.pool.service} on {dep.pool.host} at {server.address} (pids "
                  f"{server.pids}), chunk {dep.pool.chunk_size} tokens", flush=True)
        topo.children = _children(procs, prefix, env)
        topo.endpoint = place.url(dep.proxy.host, dep.proxy.port)
        return supervise(topo, log_dir, health_timeout, on_ready)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return interrupted
    except RuntimeError as e:  # the namespaces could not be made
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C / SIGTERM must not cut the teardown short (each step has a deadline).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            topo.stop()
        finally:
            if bridge is not None:
                removed = bridge.delete()
                print(f"removed {len(removed)} namespaces / links of {bridge.run_name}",
                      flush=True)
