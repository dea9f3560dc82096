"""The deployment file of `pdkv up --deploy FILE`: hosts with addresses, the roles each host runs
(prefill and decode engines with their flags, the proxy with its routing, a pool service) and
an optional rate and delay per host link, read from TOML into frozen dataclasses (torch-free).

    model = "tiny-llama-kv2"                  # every engine's --model, the proxy's tokenizer
    engine_args = ["--max-model-len", "512"]  # flags of every engine (pdkv serve's names)
    kv_transfer = "tcp"                       # optional: tcp (default) | mooncake | shm
    transfer_mode = "pull"                    # optional: pull (default) | push (docs/PUSH.md)
    kv_load_failure_policy = "fail"           # optional: fail (default) | recompute
    kv_lease_duration = 30.0                  # optional (s): how long P holds blocks for D
    transfer_timeout = 30.0                   # optional (s): the deadline of one pull of D

    [hosts.node-p]
    address = "10.0.0.11"
    link = { rate = "1gbit", delay = "1ms" }  # optional (applied by --netns)

    [[prefill]]                               # one table per engine
    host = "node-p"
    port = 8100
    kv_port = 14600                           # optional: P2P control port (0 = any)
    transfer_port = 14700                     # optional: tcp data port (0 = any)
    kv_events_port = 5557                     # optional, kv_aware proxy: KV events (+1: replay)
    args = ["--num-kv-blocks", "128"]         # optional: this engine's own flags

    [[decode]]
    host = "node-d"
    port = 8100
    worker_hosts = ["node-d1"]                # optional: TP ranks on more hosts (nodes 1..)
    master_port = 29500                       # optional: rendezvous on `host` (+1: control)

    [proxy]
    host = "node-d"
    port = 8000
    routing = "round_robin"                   # optional
    timeout = 600.0                           # optional (s): per-leg timeout
    health_check_interval = 10.0              # optional (s): between two probes of each engine

    [pool]                                    # optional: a shared KV pool
    service = "redis"                         # redis | mooncake
    host = "node-pool"
    port = 6379                               # redis' port; mooncake: the master's RPC port
    chunk_size = 256                          # optional, tokens
    segment_bytes = 1073741824                # optional, mooncake only: the store's memory

Every error is a `DeploymentError` naming the file, the key (as `prefill[1].port`) and, where
it can be found, its line.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdkv.launch.delay_line import delay_seconds
from pdkv.launch.netns import LinkShape, rate_bytes_per_s
from pdkv.launch.topology import engine_world_size
from pdkv.router.policies import KV_EVENT_POLICIES, POLICY_NAMES
from pdkv.router.pool_topology import DEFAULT_CHUNK_SIZE, MOONCAKE_SEGMENT_BYTES

KV_TRANSFERS = ("tcp", "mooncake", "shm")
LOAD_FAILURE_POLICIES = ("fail", "recompute")
TRANSFER_MODES = ("pull", "push")
"""The P2PConnector's kv_connector_extra_config.transfer_mode on every engine (docs/PUSH.md)."""
POOL_SERVICES = ("redis", "mooncake")
ROUTINGS = tuple(sorted(POLICY_NAMES))
"""Routing policies a deployment's proxy may use (under a kv_aware one every engine publishes
its KV events at its host's address; pdkv.launch.deploy_run.kv_events_config)."""

LAUNCHER_FLAGS = ("--host", "--port", "--model", "--kv-transfer-config", "--nnodes", "--node-rank",
                  "--master-addr", "--master-port", "--headless")
"""Engine flags the launcher sets itself from the file (refused in `engine_args` / `args`)."""

DEFAULT_MASTER_PORT = 29500
"""An engine's torch.distributed port on its host when its ranks span hosts (vLLM's and
torch's usual one); the next port takes the executor's control channels."""

_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")


class DeploymentError(ValueError):
    """A deployment file that cannot be used; the message names the file, the key and the line
    where it was found."""


@dataclass(frozen=True)
class Host:
    """A machine: its name in the file, its IP `address`, its `link` (rate, delay: tc syntax;
    None = not shaped)."""

    name: str
    address: str
    link: LinkShape = LinkShape()


@dataclass(frozen=True)
class Engine:
    """One `pdkv serve`: `role` "prefill" (kv_producer) or "decode" (kv_consumer), `index`
    among the engines of its role, its `host`, HTTP `port`, for a prefill engine the P2P
    control (`kv_port`) and tcp data (`transfer_port`) ports (0 = any free one, advertised in
    kv_transfer_params; rank r of a TP engine uses port + r), and its own flags `args`.

    `kv_events_port`: under a kv_aware proxy, the port of the engine's KV event PUB socket on
    its host (the replay socket: the next one; 0 = any free ones, read by the proxy from the
    engine's GET /kv_events).

    `worker_hosts`: the hosts of nodes 1, 2, ... when the engine's ranks span hosts (vLLM's
    multi-node mode: `host` is node 0, which runs the engine and the first world / nnodes
    ranks; each worker host runs `pdkv serve --headless` with the next ones); `master_port`:
    torch.distributed's port on `host` then, the next port the workers' control channels."""

    role: str
    index: int
    host: str
    port: int
    args: tuple[str, ...] = ()
    kv_port: int = 0
    transfer_port: int = 0
    worker_hosts: tuple[str, ...] = ()
    master_port: int = DEFAULT_MASTER_PORT
    kv_events_port: int = 0

    @property
    def nnodes(self) -> int:
        """Hosts the engine's ranks run on (1 + its worker hosts)."""
        return 1 + len(self.worker_hosts)

    @property
    def name(self) -> str:
        """"prefill0", "decode1", ..."""
        return f"{self.role}{self.index}"


@dataclass(frozen=True)
class Proxy:
    """`pdkv proxy` in P/D mode on `host`:`port` with `routing`; `timeout` (its `--timeout`, s:
    how long a leg may go without an answer) and `health_check_interval` (its
    `--health-check-interval-secs`): None = the proxy's defaults."""

    host: str
    port: int
    routing: str = "round_robin"
    timeout: float | None = None
    health_check_interval: float | None = None


@dataclass(frozen=True)
class Pool:
    """A KV pool service on `host`, shared by every engine through a MultiConnector; chunks of
    `chunk_size` tokens. `service` "redis": redis-server on `port`; "mooncake": mooncake_master
    with its RPC on `port` and its Prometheus metrics on `port` + 1, and a Mooncake Store
    process mounting `segment_bytes` of memory (the pool's capacity; unused by redis)."""

    service: str
    host: str
    port: int
    chunk_size: int = DEFAULT_CHUNK_SIZE
    segment_bytes: int = MOONCAKE_SEGMENT_BYTES

    @property
    def ports(self) -> int:
        """Consecutive ports the service listens on from `port` (mooncake: RPC, metrics)."""
        return 2 if self.service == "mooncake" else 1


@dataclass(frozen=True)
class Deployment:
    """A whole deployment (see the module doc). `engine_args` go to every engine before its own
    `args`; `kv_lease_duration` and `transfer_timeout` go into every P2PConnector's extra config
    (None = the connector's defaults); `source` is the file it was read from."""

    model: str
    hosts: tuple[Host, ...]
    prefill: tuple[Engine, ...]
    decode: tuple[Engine, ...]
    proxy: Proxy
    pool: Pool | None = None
    engine_args: tuple[str, ...] = ()
    kv_transfer: str = "tcp"
    transfer_mode: str = "pull"
    kv_load_failure_policy: str = "fail"
    kv_lease_duration: float | None = None
    transfer_timeout: float | None = None
    source: str = "<deployment>"

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Prefill engines first, then decode engines."""
        return self.prefill + self.decode

    def host(self, name: str) -> Host:
        """The host called `name`.

        Raises:
            KeyError: no such host.
        """
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)


class _Reader:
    """Checks one parsed file; `fail` raises with the key path and its line in `text`."""

    def __init__(self, text: str, source: str) -> None:
        self.lines = text.splitlines()
        self.source = source

    def fail(self, path: Sequence[str | int], message: str) -> DeploymentError:
        key = _key_name(path)
        line = self._line_of(path)
        where = f"{self.source}:{line}" if line else self.source
        return DeploymentError(f"{where}: {key}: {message}" if key else f"{where}: {message}")

    def _line_of(self, path: Sequence[str | int]) -> int | None:
        """1-based line of `path`'s key: the n-th `[[table]]` / the `[a.b]` header, then the
        key's `name =` line before the next header. None when not found (inline tables)."""
        start, end = 0, len(self.lines)
        rest = list(path)
        if len(rest) >= 2 and isinstance(rest[1], int):
            headers = [i for i, ln in enumerate(self.lines)
                       if re.match(rf"\s*\[\[\s*{re.escape(str(rest[0]))}\s*\]\]", ln)]
            if rest[1] >= len(headers):
                return None
            start, rest = headers[rest[1]], rest[2:]
            end = self._next_header(start)
        elif len(rest) >= 2 and rest[0] == "hosts":
            pat = rf"\s*\[\s*hosts\.\"?{re.escape(str(rest[1]))}\"?\s*\]"
            found = [i for i, ln in enumerate(self.lines) if re.match(pat, ln)]
            if not found:
                return None
            start, rest = found[0], rest[2:]
            end = self._next_header(start)
        elif len(rest) >= 1 and rest[0] in ("proxy", "pool"):
            found = [i for i, ln in enumerate(self.lines)
                     if re.match(rf"\s*\[\s*{rest[0]}\s*\]", ln)]
            if not found:
                return None
            start, rest = found[0], rest[1:]
            end = self._next_header(start)
        else:
            end = self._next_header(-1)
        if not rest:
            return start + 1
        for i in range(start, end):
            if re.match(rf"\s*\"?{re.escape(str(rest[0]))}\"?\s*=", self.lines[i]):
                return i + 1
        return None

    def _next_header(self, after: int) -> int:
        for i in range(after + 1, len(self.lines)):
            if re.match(r"\s*\[", self.lines[i]):
                return i
        return len(self.lines)

    def table(self, value: Any, path: Sequence[str | int], allowed: Sequence[str],
              required: Sequence[str] = ()) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a table, got {_kind(value)}")
        for key in value:
            if key not in allowed:
                raise self.fail([*path, key],
                                f"unknown key (known here: {', '.join(allowed)})")
        for key in required:
            if key not in value:
                raise self.fail(path, f"missing key {key!r}")
        return value

    def string(self, value: Any, path: Sequence[str | int], choices: Sequence[str] = ()) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {_kind(value)}")
        if choices and value not in choices:
            raise self.fail(path, f"{value!r} is not one of {', '.join(choices)}")
        return value

    def port(self, value: Any, path: Sequence[str | int], zero: bool = False) -> int:
        low = 0 if zero else 1
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 65535:
            raise self.fail(path, f"must be a port number {low}-65535, got {value!r}")
        return value

    def seconds(self, value: Any, path: Sequence[str | int]) -> float | None:
        """A duration > 0 in seconds (an integer or a float), None when absent."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.fail(path, f"must be a number of seconds > 0, got {value!r}")
        return float(value)

    def flags(self, value: Any, path: Sequence[str | int]) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise self.fail(path, "must be a list of strings (flags of pdkv serve)")
        for a in value:
            if a.split("=", 1)[0] in LAUNCHER_FLAGS:
                raise self.fail(path, f"{a.split('=', 1)[0]} is set by the launcher from the "
                                      "deployment (model, host, port, KV connectors): leave it out")
        return tuple(value)


def _key_name(path: Sequence[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _kind(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a float"}.get(type(value), type(value).__name__)


def parse_deployment(text: str, source: str = "<deployment>") -> Deployment:
    """A deployment from TOML `text` (`source` names it in errors).

    Raises:
        DeploymentError: malformed TOML (tomllib's line and column), an unknown or missing key,
            a value of the wrong type or out of range, a role on an unknown host, two listening
            ports that meet on one host, two hosts with one address, no prefill or no decode
            engine, shm across hosts, a transfer_port without the tcp transfer, segment_bytes
            of a pool other than mooncake; or Python < 3.11 (no tomllib).
    """
    if sys.version_info < (3, 11):
        raise DeploymentError(f"{source}: reading a deployment file needs Python 3.11 (tomllib)")
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise DeploymentError(f"{source}: not valid TOML: {e}") from e
    r = _Reader(text, source)
    top = r.table(data, [], ("model", "engine_args", "kv_transfer", "transfer_mode",
                             "kv_load_failure_policy",
                             "kv_lease_duration", "transfer_timeout", "hosts", "prefill",
                             "decode", "proxy", "pool"),
                  required=("model", "hosts", "prefill", "decode", "proxy"))
    hosts = _hosts(r, top["hosts"])
    names = [h.name for h in hosts]

    def host_of(value: Any, path: list[str | int]) -> str:
        name = r.string(value, path)
        if name not in names:
            raise r.fail(path, f"unknown host {name!r} (hosts: {', '.join(names)})")
        return name

    engines: dict[str, list[Engine]] = {"prefill": [], "decode": []}
    for role in ("prefill", "decode"):
        tables = top[role]
        if not isinstance(tables, list) or not tables:
            raise r.fail([role], f"needs at least one [[{role}]] table")
        for i, t in enumerate(tables):
            allowed = ["host", "port", "args", "worker_hosts", "master_port", "kv_events_port"]
            if role == "prefill":
                allowed += ["kv_port", "transfer_port"]
            t = r.table(t, [role, i], allowed, required=("host", "port"))
            engine = Engine(
                role=role, index=i, host=host_of(t["host"], [role, i, "host"]),
                port=r.port(t["port"], [role, i, "port"]),
                args=r.flags(t.get("args", []), [role, i, "args"]),
                kv_port=r.port(t.get("kv_port", 0), [role, i, "kv_port"], zero=True),
                transfer_port=r.port(t.get("transfer_port", 0), [role, i, "transfer_port"],
                                     zero=True),
                worker_hosts=_worker_hosts(r, t, [role, i], host_of),
                master_port=r.port(t.get("master_port", DEFAULT_MASTER_PORT),
                                   [role, i, "master_port"]),
                kv_events_port=r.port(t.get("kv_events_port", 0), [role, i, "kv_events_port"],
                                      zero=True))
            engines[role].append(engine)
    p = r.table(top["proxy"], ["proxy"],
                ("host", "port", "routing", "timeout", "health_check_interval"),
                required=("host", "port"))
    proxy = Proxy(host=host_of(p["host"], ["proxy", "host"]),
                  port=r.port(p["port"], ["proxy", "port"]),
                  routing=r.string(p.get("routing", "round_robin"), ["proxy", "routing"],
                                   ROUTINGS),
                  timeout=r.seconds(p.get("timeout"), ["proxy", "timeout"]),
                  health_check_interval=r.seconds(p.get("health_check_interval"),
                                                  ["proxy", "health_check_interval"]))
    pool = None
    if "pool" in top:
        t = r.table(top["pool"], ["pool"],
                    ("service", "host", "port", "chunk_size", "segment_bytes"),
                    required=("service", "host", "port"))
        service = r.string(t["service"], ["pool", "service"], POOL_SERVICES)
        sizes = {}
        for key, default in (("chunk_size", DEFAULT_CHUNK_SIZE),
                             ("segment_bytes", MOONCAKE_SEGMENT_BYTES)):
            value = t.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise r.fail(["pool", key], f"must be a positive integer, got {value!r}")
            sizes[key] = value
        if "segment_bytes" in t and service != "mooncake":
            raise r.fail(["pool", "segment_bytes"], "only a mooncake pool mounts a segment "
                                                    f"(this pool is {service})")
        pool = Pool(service=service, host=host_of(t["host"], ["pool", "host"]),
                    port=r.port(t["port"], ["pool", "port"]), **sizes)
    dep = Deployment(
        model=r.string(top["model"], ["model"]),
        hosts=hosts,
        prefill=tuple(engines["prefill"]),
        decode=tuple(engines["decode"]),
        proxy=proxy,
        pool=pool,
        engine_args=r.flags(top.get("engine_args", []), ["engine_args"]),
        kv_transfer=r.string(top.get("kv_transfer", "tcp"), ["kv_transfer"], KV_TRANSFERS),
        transfer_mode=r.string(top.get("transfer_mode", "pull"), ["transfer_mode"],
                               TRANSFER_MODES),
        kv_load_failure_policy=r.string(top.get("kv_load_failure_policy", "fail"),
                                        ["kv_load_failure_policy"], LOAD_FAILURE_POLICIES),
        kv_lease_duration=r.seconds(top.get("kv_lease_duration"), ["kv_lease_duration"]),
        transfer_timeout=r.seconds(top.get("transfer_timeout"), ["transfer_timeout"]),
        source=source,
    )
    if proxy.routing not in KV_EVENT_POLICIES:
        for e in dep.engines:
            if e.kv_events_port:
                raise r.fail([e.role, e.index, "kv_events_port"],
                             "the engines publish KV events only for a kv_aware proxy (routing "
                             f"{' or '.join(KV_EVENT_POLICIES)}), not {proxy.routing}")
    _check_ports(r, dep)
    for e in dep.engines:
        world = engine_world_size([*dep.engine_args, *e.args])
        if e.nnodes > 1 and world % e.nnodes:
            raise r.fail([e.role, e.index, "worker_hosts"],
                         f"{e.nnodes} hosts must split the engine's {world} TP ranks evenly "
                         "(give -tp in args / engine_args)")
    for e in dep.prefill:
        if e.transfer_port and dep.kv_transfer != "tcp":
            raise r.fail(["prefill", e.index, "transfer_port"],
                         f"only the tcp transfer engine has a data port (kv_transfer is "
                         f"{dep.kv_transfer!r}: it picks its own ports)")
    if dep.kv_transfer == "shm" and len({e.host for e in dep.engines}) > 1:
        raise r.fail(["kv_transfer"], "shm moves KV through this machine's shared memory: every "
                                      "engine must be on one host (use tcp or mooncake)")
    return dep


def _worker_hosts(r: _Reader, t: dict[str, Any], path: list[str | int],
                  host_of: Any) -> tuple[str, ...]:
    """An engine's `worker_hosts`: known hosts, none twice, not the engine's own host."""
    value = t.get("worker_hosts", [])
    key = [*path, "worker_hosts"]
    if not isinstance(value, list):
        raise r.fail(key, f"must be a list of host names, got {_kind(value)}")
    out = tuple(host_of(h, key) for h in value)
    if len(set(out)) != len(out) or t["host"] in out:
        raise r.fail(key, "each host holds one node of the engine: no host twice, and not the "
                          f"engine's own host {t['host']!r}")
    return out


def _hosts(r: _Reader, value: Any) -> tuple[Host, ...]:
    if not isinstance(value, dict) or not value:
        raise r.fail(["hosts"], "needs at least one [hosts.NAME] table")
    hosts = []
    seen: dict[str, str] = {}
    for name, t in value.items():
        path: list[str | int] = ["hosts", name]
        if not _HOST_NAME.fullmatch(name):
            raise r.fail(path, "a host name is 1-32 letters, digits, - or _")
        t = r.table(t, path, ("address", "link"), required=("address",))
        address = r.string(t["address"], [*path, "address"])
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise r.fail([*path, "address"], f"{address!r} is not an IP address") from None
        if address in seen:
            raise r.fail([*path, "address"], f"{address} is also host {seen[address]!r}'s")
        seen[address] = name
        link = LinkShape()
        if "link" in t:
            lk = r.table(t["link"], [*path, "link"], ("rate", "delay"))
            rate = lk.get("rate")
            delay = lk.get("delay")
            try:
                if rate is not None:
                    rate_bytes_per_s(r.string(rate, [*path, "link", "rate"]))
                if delay is not None:
                    delay_seconds(r.string(delay, [*path, "link", "delay"]))
            except ValueError as e:
                if isinstance(e, DeploymentError):
                    raise
                raise r.fail([*path, "link"], str(e)) from None
            link = LinkShape(rate=rate, delay=delay)
        hosts.append(Host(name=name, address=address, link=link))
    return tuple(hosts)


def listening_ports(dep: Deployment) -> list[tuple[str, str, int, int]]:
    """Every port the deployment listens on as (key, host, first port, count): engines' HTTP
    ports, a prefill engine's kv_port / transfer_port (one per TP rank; 0 = system-chosen, left
    out), an engine's master_port and the next one when its ranks span hosts, an engine's
    kv_events_port and the next one (replay), the proxy's and the pool's (a mooncake pool's
    master: its RPC port and the next one, its metrics)."""
    out: list[tuple[str, str, int, int]] = []
    for e in dep.engines:
        out.append((f"{e.role}[{e.index}].port", e.host, e.port, 1))
        if e.worker_hosts:
            out.append((f"{e.role}[{e.index}].master_port", e.host, e.master_port, 2))
        if e.kv_events_port:
            out.append((f"{e.role}[{e.index}].kv_events_port", e.host, e.kv_events_port, 2))
        ranks = engine_world_size([*dep.engine_args, *e.args])
        for key, port in (("kv_port", e.kv_port), ("transfer_port", e.transfer_port)):
            if port:
                out.append((f"{e.role}[{e.index}].{key}", e.host, port, ranks))
    out.append(("proxy.port", dep.proxy.host, dep.proxy.port, 1))
    if dep.pool is not None:
        out.append(("pool.port", dep.pool.host, dep.pool.port, dep.pool.ports))
    return out


def _check_ports(r: _Reader, dep: Deployment) -> None:
    taken: dict[tuple[str, int], str] = {}
    for key, host, first, count in listening_ports(dep):
        for port in range(first, first + count):
            if port > 65535:
                raise r.fail(_path(key), f"ports {first}-{first + count - 1} go past 65535")
            other = taken.get((host, port))
            if other is not None:
                raise r.fail(_path(key), f"port {port} on host {host!r} is also {other}")
            taken[(host, port)] = key


def _path(key: str) -> list[str | int]:
    """"prefill[1].port" → ["prefill", 1, "port"]."""
    out: list[str | int] = []
    for part in key.split("."):
        m = re.fullmatch(r"(\w+)\[(\d+)\]", part)
        out += [m.group(1), int(m.group(2))] if m else [part]
    return out


def load_deployment(path: str) -> Deployment:
    """The deployment in the file at `path`.

    Raises:
        DeploymentError: the file cannot be read, or as `parse_deployment`.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise DeploymentError(f"{path}: cannot read the deployment file: {e}") from e
    return parse_deployment(text, path)
