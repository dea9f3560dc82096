"""The deployment file of `pdkv up --deploy` (pdkv/launch/deploy.py): the examples parse, a
malformed file is refused naming the key and its line, `--print-commands` prints per host what
to run on real machines, and the loopback placement keeps ports distinct. No process starts."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

import pytest

from pdkv.launch import deploy_run, launcher
from pdkv.launch.deploy import DeploymentError, load_deployment, parse_deployment
from pdkv.launch.netns import LinkShape

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EXAMPLES = os.path.join(ROOT, "examples", "deploy")
ONE_P_ONE_D = os.path.join(EXAMPLES, "1p1d.toml")
TWO_P_POOL = os.path.join(EXAMPLES, "2p1d-pool.toml")
TP_TWO_HOSTS = os.path.join(EXAMPLES, "1p1d-tp2-two-hosts.toml")
KV_AWARE = os.path.join(EXAMPLES, "2p1d-kv-aware.toml")
MOONCAKE = os.path.join(EXAMPLES, "1p1d-mooncake.toml")

BASE = """\
model = "tiny-llama-kv2"

[hosts.a]
address = "10.0.0.1"

[hosts.b]
address = "10.0.0.2"

[[prefill]]
host = "a"
port = 8100

[[decode]]
host = "b"
port = 8100

[proxy]
host = "b"
port = 8000
"""


def test_the_examples_parse():
    one = load_deployment(ONE_P_ONE_D)
    assert [h.name for h in one.hosts] == ["node-p", "node-d"]
    assert one.host("node-p").link == LinkShape(rate="1gbit")
    assert [e.name for e in one.engines] == ["prefill0", "decode0"]
    assert (one.prefill[0].kv_port, one.prefill[0].transfer_port) == (14600, 14700)
    assert one.pool is None and one.kv_transfer == "tcp"
    two = load_deployment(TWO_P_POOL)
    assert [e.host for e in two.prefill] == ["node-p0", "node-p1"]
    assert two.pool is not None and (two.pool.host, two.pool.port) == ("node-pool", 6379)
    assert two.proxy.routing == "least_loaded"
    tp = load_deployment(TP_TWO_HOSTS)
    (d,) = tp.decode
    assert (d.host, d.worker_hosts, d.nnodes, d.master_port) == ("node-d0", ("node-d1",), 2, 29500)
    assert tp.prefill[0].worker_hosts == () and tp.prefill[0].nnodes == 1
    mc = load_deployment(MOONCAKE)
    assert mc.kv_transfer == "mooncake" and mc.pool is not None
    assert (mc.pool.service, mc.pool.host, mc.pool.port, mc.pool.ports) == (
        "mooncake", "node-pool", 50051, 2)
    assert (mc.pool.chunk_size, mc.pool.segment_bytes) == (64, 256 << 20)
    assert (mc.prefill[0].kv_port, mc.prefill[0].transfer_port) == (14600, 0)


def test_print_commands_tp2_on_two_hosts():
    """D's engine on node-d0 with vLLM's multi-node flags (node rank 0), D's rank 1 headless on
    node-d1 joined to node-d0's address; the same model and engine flags on both nodes."""
    hosts = _sections(deploy_run.format_commands(load_deployment(TP_TWO_HOSTS)))
    assert list(hosts) == ["node-p", "node-d0", "node-d1"]
    d0, _proxy = [shlex.split(c) for c in hosts["node-d0"]]
    (d1,) = [shlex.split(c) for c in hosts["node-d1"]]
    for argv, rank in ((d0, "0"), (d1, "1")):
        assert argv[:2] == ["pdkv", "serve"] and _flag(argv, "--model") == "tiny-llama-kv2"
        assert (_flag(argv, "-tp"), _flag(argv, "--nnodes"), _flag(argv, "--node-rank")) == (
            "2", "2", rank)
        assert (_flag(argv, "--master-addr"), _flag(argv, "--master-port")) == (
            "10.0.0.12", "29500")
        assert _flag(argv, "--num-kv-blocks") == "64"
    assert "--headless" in d1 and "--headless" not in d0
    assert "--port" not in d1 and "--kv-transfer-config" not in d1  # the leader sends its own
    cfg = json.loads(_flag(d0, "--kv-transfer-config"))
    assert cfg["kv_connector_extra_config"]["kv_advertise_host"] == "10.0.0.12"
    place = deploy_run.on_loopback(load_deployment(TP_TWO_HOSTS))
    rendezvous = place.port("node-d0", 29500)
    assert place.port("node-d0", 29501) == rendezvous + 1  # the control port stays the next one


def _edit(old: str, new: str, text: str = BASE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# (file text, the error's text); the line number is checked where the key is on its own line.
BAD = [
    pytest.param("model = \n", "not valid TOML", id="toml-syntax"),
    pytest.param("replicas = 2\n" + BASE, ":1: replicas: unknown key", id="unknown-top-key"),
    pytest.param(_edit('host = "a"\nport = 8100', 'host = "a"\nport = 8100\ngpus = 2'),
                 ":12: prefill[0].gpus: unknown key", id="unknown-engine-key"),
    pytest.param(_edit('host = "b"\nport = 8100', 'host = "b"\nport = 8100\nkv_port = 9'),
                 ":16: decode[0].kv_port: unknown key", id="kv-port-on-decode"),
    pytest.param(_edit('[[prefill]]\nhost = "a"', '[[prefill]]\nhost = "c"'),
                 ':10: prefill[0].host: unknown host \'c\' (hosts: a, b)', id="unknown-host"),
    pytest.param(_edit('[proxy]\nhost = "b"', '[proxy]\nhost = "z"'),
                 ":18: proxy.host: unknown host 'z'", id="proxy-unknown-host"),
    pytest.param(_edit("port = 8000", "port = 8100"),
                 ":19: proxy.port: port 8100 on host 'b' is also decode[0].port",
                 id="duplicate-port"),
    pytest.param(_edit('host = "a"\nport = 8100', 'host = "a"\nport = 8100\nkv_port = 8100'),
                 ":12: prefill[0].kv_port: port 8100 on host 'a' is also prefill[0].port",
                 id="kv-port-is-http-port"),
    pytest.param(
        _edit('host = "a"\nport = 8100',
              'host = "a"\nport = 8100\nkv_port = 9000\ntransfer_port = 9001\n'
              'args = ["-tp", "2"]'),
        "prefill[0].transfer_port: port 9001 on host 'a' is also prefill[0].kv_port",
        id="tp-rank-ports-overlap"),
    pytest.param(_edit('address = "10.0.0.2"', 'address = "10.0.0.1"'),
                 ":7: hosts.b.address: 10.0.0.1 is also host 'a''s", id="duplicate-address"),
    pytest.param(_edit('address = "10.0.0.2"', 'address = "node-b.local"'),
                 "hosts.b.address: 'node-b.local' is not an IP address", id="not-an-address"),
    pytest.param(_edit('address = "10.0.0.1"', 'address = "10.0.0.1"\nlink = { rate = "fast" }'),
                 ":5: hosts.a.link: rate must look like 1gbit", id="bad-rate"),
    pytest.param(_edit('address = "10.0.0.1"', 'address = "10.0.0.1"\nlink = { delay = "1" }'),
                 "hosts.a.link: delay must look like 1ms", id="bad-delay"),
    pytest.param(_edit('address = "10.0.0.1"', 'address = "10.0.0.1"\nlink = { loss = 1 }'),
                 "hosts.a.link.loss: unknown key", id="unknown-link-key"),
    pytest.param(_edit('model = "tiny-llama-kv2"\n', ""), "missing key 'model'", id="no-model"),
    pytest.param(_edit('host = "a"\nport = 8100\n', 'host = "a"\n'),
                 ":9: prefill[0]: missing key 'port'", id="no-port"),
    pytest.param(_edit("port = 8000", "port = 70000"),
                 ":19: proxy.port: must be a port number 1-65535, got 70000", id="port-range"),
    pytest.param(_edit("port = 8000", "port = true"),
                 "proxy.port: must be a port number 1-65535, got True", id="port-bool"),
    pytest.param(_edit('host = "a"\nport = 8100', 'host = "a"\nport = 8100\nargs = ["--port=1"]'),
                 ":12: prefill[0].args: --port is set by the launcher", id="launcher-flag"),
    pytest.param('engine_args = ["--kv-transfer-config", "{}"]\n' + BASE,
                 ":1: engine_args: --kv-transfer-config is set by the launcher",
                 id="own-kv-transfer-config"),
    pytest.param(_edit('host = "a"\nport = 8100', 'host = "a"\nport = 8100\nargs = "-tp 2"'),
                 "prefill[0].args: must be a list of strings", id="args-not-a-list"),
    pytest.param(_edit('[[decode]]\nhost = "b"\nport = 8100\n', ""),
                 "missing key 'decode'", id="no-decode"),
    pytest.param("decode = []\n" + _edit('[[decode]]\nhost = "b"\nport = 8100\n', ""),
                 "decode: needs at least one [[decode]] table", id="empty-decode"),
    pytest.param('kv_transfer = "shm"\n' + BASE, ":1: kv_transfer: shm moves KV",
                 id="shm-across-hosts"),
    pytest.param('kv_transfer = "nccl"\n' + BASE,
                 "kv_transfer: 'nccl' is not one of tcp, mooncake, shm", id="unknown-transfer"),
    pytest.param(_edit('[proxy]\nhost = "b"\nport = 8000', '[proxy]\nhost = "b"\nport = 8000\n'
                                                          'routing = "kv_awar"'),
                 ":20: proxy.routing: 'kv_awar' is not one of", id="unknown-routing"),
    pytest.param(_edit('host = "a"\nport = 8100', 'host = "a"\nport = 8100\nkv_events_port = 5557'),
                 ":12: prefill[0].kv_events_port: the engines publish KV events only for a "
                 "kv_aware proxy", id="kv-events-port-without-kv-aware"),
    pytest.param(_edit('host = "a"\nport = 8100', 'host = "a"\nport = 8100\nkv_events_port = 8099')
                 + 'routing = "kv_aware"\n',
                 ":12: prefill[0].kv_events_port: port 8100 on host 'a' is also prefill[0].port",
                 id="kv-events-replay-port-taken"),
    pytest.param(BASE + '[pool]\nservice = "valkey"\nhost = "a"\nport = 6379\n',
                 ":21: pool.service: 'valkey' is not one of redis, mooncake", id="pool-service"),
    pytest.param(BASE + '[pool]\nservice = "redis"\nhost = "a"\nport = 6379\n'
                 'segment_bytes = 1024\n',
                 ":24: pool.segment_bytes: only a mooncake pool mounts a segment",
                 id="segment-bytes-redis"),
    pytest.param(BASE + '[pool]\nservice = "mooncake"\nhost = "a"\nport = 6379\n'
                 'segment_bytes = -1\n',
                 ":24: pool.segment_bytes: must be a positive integer", id="segment-bytes"),
    pytest.param(BASE + '[pool]\nservice = "mooncake"\nhost = "b"\nport = 7999\n',
                 ":23: pool.port: port 8000 on host 'b' is also proxy.port",
                 id="mooncake-metrics-port-taken"),
    pytest.param(BASE + '[pool]\nservice = "mooncake"\nhost = "a"\nport = 65535\n',
                 ":23: pool.port: ports 65535-65536 go past 65535", id="mooncake-port-max"),
    pytest.param('kv_transfer = "mooncake"\n' + _edit('host = "a"\nport = 8100',
                                                     'host = "a"\nport = 8100\n'
                                                     'transfer_port = 14700'),
                 ":13: prefill[0].transfer_port: only the tcp transfer engine has a data port",
                 id="transfer-port-mooncake"),
    pytest.param(BASE + '[pool]\nservice = "redis"\nhost = "a"\nport = 6379\nchunk_size = 0\n',
                 ":24: pool.chunk_size: must be a positive integer", id="chunk-size"),
    pytest.param(_edit("[hosts.b]", '[hosts."b c"]').replace('"b"', '"b c"'),
                 "hosts.b c: a host name is 1-32 letters", id="host-name"),
    pytest.param("kv_lease_duration = 0\n" + BASE,
                 ":1: kv_lease_duration: must be a number of seconds > 0, got 0", id="lease"),
    pytest.param('transfer_timeout = "5s"\n' + BASE,
                 ":1: transfer_timeout: must be a number of seconds > 0, got '5s'",
                 id="transfer-timeout"),
    pytest.param(_edit("port = 8000", "port = 8000\ntimeout = -1"),
                 ":20: proxy.timeout: must be a number of seconds > 0", id="proxy-timeout"),
    pytest.param(_edit("port = 8000", "port = 8000\nhealth_check_interval = true"),
                 ":20: proxy.health_check_interval: must be a number of seconds > 0",
                 id="health-check-interval"),
    pytest.param(_edit('host = "b"\nport = 8100', 'host = "b"\nport = 8100\n'
                       'worker_hosts = ["c"]'),
                 ":16: decode[0].worker_hosts: unknown host 'c'", id="unknown-worker-host"),
    pytest.param(_edit('host = "b"\nport = 8100', 'host = "b"\nport = 8100\n'
                       'worker_hosts = ["b"]'),
                 "decode[0].worker_hosts: each host holds one node", id="worker-host-twice"),
    pytest.param(_edit('host = "b"\nport = 8100', 'host = "b"\nport = 8100\n'
                       'worker_hosts = ["a"]'),
                 "decode[0].worker_hosts: 2 hosts must split the engine's 1 TP ranks evenly",
                 id="worker-hosts-without-tp"),
    pytest.param(_edit('host = "b"\nport = 8100', 'host = "b"\nport = 8100\n'
                       'args = ["-tp", "2", "--nnodes", "2"]'),
                 "--nnodes is set by the launcher", id="nnodes-flag"),
    pytest.param(_edit('host = "b"\nport = 8100', 'host = "b"\nport = 8100\n'
                       'worker_hosts = ["a"]\nmaster_port = 8000\nargs = ["-tp", "2"]'),
                 "port 8000 on host 'b' is also decode[0].master_port", id="master-port-taken"),
    pytest.param('model = "m"\nhosts = {}\n' + BASE[BASE.index("[[prefill]]"):],
                 ":2: hosts: needs at least one [hosts.NAME]",
                 id="no-hosts"),
]


@pytest.mark.parametrize("text, message", BAD)
def test_a_malformed_file_is_refused_naming_the_key_and_line(text, message):
    with pytest.raises(DeploymentError) as info:
        parse_deployment(text, "dep.toml")
    assert str(info.value).startswith("dep.toml"), str(info.value)
    assert message in str(info.value), str(info.value)


def test_one_port_on_two_hosts_is_fine_and_loopback_makes_them_distinct():
    dep = parse_deployment(_edit('host = "a"\nport = 8100',
                                 'host = "a"\nport = 8100\nkv_port = 9000\nargs = ["-tp", "2"]'))
    place = deploy_run.on_loopback(dep)
    ports = [place.port("a", 8100), place.port("b", 8100), place.port("b", 8000),
             place.port("a", 9000), place.port("a", 9001)]
    assert len(set(ports)) == 5
    assert ports[4] == ports[3] + 1  # a TP engine's rank ports stay consecutive
    assert place.port("a", 0) == 0 and set(place.addresses.values()) == {"127.0.0.1"}


def test_a_missing_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(DeploymentError, match="nope.toml: cannot read"):
        load_deployment(str(tmp_path / "nope.toml"))


def _sections(text: str) -> dict[str, list[str]]:
    """Host name → its command lines (comments left out)."""
    out: dict[str, list[str]] = {}
    host = None
    for line in text.splitlines():
        if line.startswith("# host "):
            host = line.split()[2]
            out[host] = []
        elif line and not line.startswith("#") and host is not None:
            out[host].append(line)
    return out


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_print_commands_1p1d():
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "up", "--deploy", ONE_P_ONE_D, "--print-commands"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "# host node-p (10.0.0.11), link rate 1gbit" in out.stdout
    hosts = _sections(out.stdout)
    assert list(hosts) == ["node-p", "node-d"]
    (p,) = [shlex.split(c) for c in hosts["node-p"]]
    d, proxy = [shlex.split(c) for c in hosts["node-d"]]
    assert p[:2] == ["pdkv", "serve"] and _flag(p, "--model") == "tiny-llama-kv2"
    assert (_flag(p, "--host"), _flag(p, "--port")) == ("10.0.0.11", "8100")
    assert p[p.index("--num-kv-blocks") + 1] == "64"
    cfg = json.loads(_flag(p, "--kv-transfer-config"))
    assert cfg["kv_connector"] == "P2PConnector" and cfg["kv_role"] == "kv_producer"
    assert cfg["kv_connector_extra_config"] == {
        "transfer": "tcp", "kv_host": "10.0.0.11", "kv_advertise_host": "10.0.0.11",
        "kv_port": 14600, "transfer_port": 14700}
    dcfg = json.loads(_flag(d, "--kv-transfer-config"))
    assert dcfg["kv_role"] == "kv_consumer"
    assert dcfg["kv_connector_extra_config"]["kv_advertise_host"] == "10.0.0.12"
    assert proxy[:2] == ["pdkv", "proxy"]
    assert _flag(proxy, "--prefill") == "http://10.0.0.11:8100"
    assert _flag(proxy, "--decode") == "http://10.0.0.12:8100"
    assert (_flag(proxy, "--host"), _flag(proxy, "--port")) == ("10.0.0.12", "8000")
    assert _flag(proxy, "--tokenizer") == "tiny-llama-kv2"
    assert "# endpoint: http://10.0.0.12:8000" in out.stdout


def test_timeouts_reach_the_connectors_and_the_proxy():
    dep = parse_deployment("kv_lease_duration = 4\ntransfer_timeout = 2.5\n" + _edit(
        "port = 8000", "port = 8000\ntimeout = 5\nhealth_check_interval = 0.5"))
    procs = {p.name: p.argv for p in deploy_run.processes(
        dep, deploy_run.as_written(dep), ["pdkv"], "redis-server")}
    for name in ("prefill0", "decode0"):
        extra = json.loads(_flag(list(procs[name]), "--kv-transfer-config"))
        assert extra["kv_connector_extra_config"]["kv_lease_duration"] == 4.0
        assert extra["kv_connector_extra_config"]["transfer_timeout"] == 2.5
    proxy = list(procs["proxy"])
    assert (_flag(proxy, "--timeout"), _flag(proxy, "--health-check-interval-secs")) == (
        "5", "0.5")
    plain = {p.name: p.argv for p in deploy_run.processes(
        parse_deployment(BASE), deploy_run.as_written(dep), ["pdkv"], "redis-server")}
    assert "--timeout" not in plain["proxy"]
    assert "kv_lease_duration" not in _flag(list(plain["decode0"]), "--kv-transfer-config")


def test_transfer_mode_push_reaches_every_engines_p2p_connector():
    dep = parse_deployment('transfer_mode = "push"\n' + BASE)
    assert dep.transfer_mode == "push"
    for p in deploy_run.processes(dep, deploy_run.as_written(dep), ["pdkv"], None):
        if p.name in ("prefill0", "decode0"):
            cfg = json.loads(_flag(list(p.argv), "--kv-transfer-config"))
            assert cfg["kv_connector_extra_config"]["transfer_mode"] == "push"
    plain = parse_deployment(BASE)
    assert all('"transfer_mode"' not in " ".join(p.argv) for p in deploy_run.processes(
        plain, deploy_run.as_written(plain), ["pdkv"], None))
    with pytest.raises(DeploymentError, match="transfer_mode: 'pushed' is not one of pull, push"):
        parse_deployment('transfer_mode = "pushed"\n' + BASE)


def test_print_commands_2p1d_with_a_redis_pool():
    text = deploy_run.format_commands(load_deployment(TWO_P_POOL))
    hosts = _sections(text)
    assert list(hosts) == ["node-pool", "node-p0", "node-p1", "node-d"]  # in start order
    (redis,) = [shlex.split(c) for c in hosts["node-pool"]]
    assert redis == ["redis-server", "--port", "6379", "--bind", "10.0.0.14", "--save", "",
                     "--appendonly", "no", "--protected-mode", "no"]  # engines on other hosts
    pool_tier = {"name": "redis", "url": "redis://10.0.0.14:6379/0"}
    for host, address in (("node-p0", "10.0.0.11"), ("node-p1", "10.0.0.12")):
        (p,) = [shlex.split(c) for c in hosts[host]]
        cfg = json.loads(_flag(p, "--kv-transfer-config"))
        p2p, pool = cfg["kv_connector_extra_config"]["connectors"]  # P: P2P first, then the pool
        assert cfg["kv_connector"] == "MultiConnector" and cfg["kv_role"] == "kv_producer"
        assert p2p["kv_connector_extra_config"]["kv_advertise_host"] == address
        assert pool["kv_connector"] == "KVPoolConnector" and pool["kv_role"] == "kv_producer"
        assert pool["kv_connector_extra_config"] == {"chunk_size": 32, "tiers": [pool_tier]}
    d, proxy = [shlex.split(c) for c in hosts["node-d"]]
    pool, p2p = json.loads(_flag(d, "--kv-transfer-config"))["kv_connector_extra_config"][
        "connectors"]  # D: the pool first, then P2P
    assert pool["kv_connector_extra_config"]["tiers"] == [pool_tier]
    assert p2p["kv_role"] == "kv_consumer"
    assert _flag(proxy, "--prefill") == "http://10.0.0.11:8100,http://10.0.0.12:8100"
    assert _flag(proxy, "--routing") == "least_loaded"
    assert text.index("start the pool first") < text.index("# host")


def test_print_commands_kv_aware_engines_publish_at_their_hosts_address():
    text = deploy_run.format_commands(load_deployment(KV_AWARE))
    hosts = _sections(text)
    assert list(hosts) == ["node-p0", "node-p1", "node-d", "node-proxy"]
    for host, address in (("node-p0", "10.0.0.11"), ("node-p1", "10.0.0.12"),
                          ("node-d", "10.0.0.13")):
        (engine,) = [shlex.split(c) for c in hosts[host]]
        assert json.loads(_flag(engine, "--kv-events-config")) == {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://{address}:5557", "replay_endpoint": f"tcp://{address}:5558"}
    (proxy,) = [shlex.split(c) for c in hosts["node-proxy"]]
    assert (_flag(proxy, "--routing"), _flag(proxy, "--host")) == ("kv_aware", "10.0.0.14")
    assert _flag(proxy, "--prefill") == "http://10.0.0.11:8100,http://10.0.0.12:8100"
    # On loopback each engine's two event ports are free ones, consecutive, none shared.
    dep = load_deployment(KV_AWARE)
    procs = deploy_run.processes(dep, deploy_run.on_loopback(dep), ["pdkv"], "redis-server")
    ports = []
    for p in procs[:3]:
        cfg = json.loads(_flag(list(p.argv), "--kv-events-config"))
        pub, replay = (int(cfg[k].rpartition(":")[2]) for k in ("endpoint", "replay_endpoint"))
        assert cfg["endpoint"].startswith("tcp://127.0.0.1:") and replay == pub + 1
        ports += [pub, replay]
    assert len(set(ports)) == 6 and 5557 not in ports
    # Without kv_events_port: ports the system picks (the proxy reads them from GET /kv_events);
    # without a kv_aware proxy: no events at all.
    any_port = parse_deployment(BASE.replace("port = 8000", 'port = 8000\nrouting = "kv_aware"'))
    (p, *_) = deploy_run.processes(any_port, deploy_run.as_written(any_port), ["pdkv"], "r")
    assert json.loads(_flag(list(p.argv), "--kv-events-config"))["endpoint"] == "tcp://10.0.0.1:0"
    plain = deploy_run.processes(parse_deployment(BASE), deploy_run.as_written(any_port),
                                 ["pdkv"], "r")
    assert not any("--kv-events-config" in p.argv for p in plain)


def test_an_engine_id_is_fixed_only_when_asked():
    dep = load_deployment(ONE_P_ONE_D)
    procs = deploy_run.processes(dep, deploy_run.as_written(dep), ["pdkv"], "r",
                                 engine_ids={"prefill0": "chaos-prefill0"})
    p, d = (json.loads(_flag(list(x.argv), "--kv-transfer-config")) for x in procs[:2])
    assert p["engine_id"] == "chaos-prefill0" and "engine_id" not in d


def test_print_commands_1p1d_over_mooncake_with_a_mooncake_pool():
    """mooncake_master and the store process bound to the pool host's address, first in the
    start order; each engine's mooncake tier a client at its own host's address, its P2P
    connector on the mooncake transfer engine bound to and advertising that address."""
    text = deploy_run.format_commands(load_deployment(MOONCAKE))
    hosts = _sections(text)
    assert list(hosts) == ["node-pool", "node-p", "node-d"]  # in start order
    master, store = [shlex.split(c) for c in hosts["node-pool"]]
    assert master == ["mooncake_master", "--rpc_address=10.0.0.13", "--rpc_port=50051",
                      "--metrics_host=10.0.0.13", "--metrics_port=50052",
                      "--enable_http_metadata_server=false"]
    assert store == ["python", "-m", "pdkv.kvpool.mooncake_store_server", "--master",
                     "10.0.0.13:50051", "--segment-bytes", str(256 << 20), "--local-hostname",
                     "10.0.0.13"]
    (p,) = [shlex.split(c) for c in hosts["node-p"]]
    d, _proxy = [shlex.split(c) for c in hosts["node-d"]]
    for argv, address, order in ((p, "10.0.0.11", (0, 1)), (d, "10.0.0.12", (1, 0))):
        kids = json.loads(_flag(argv, "--kv-transfer-config"))["kv_connector_extra_config"][
            "connectors"]
        p2p, pool = kids[order[0]], kids[order[1]]
        extra = p2p["kv_connector_extra_config"]
        assert (extra["transfer"], extra["kv_host"], extra["kv_advertise_host"]) == (
            "mooncake", address, address)
        assert "transfer_port" not in extra
        assert pool["kv_connector_extra_config"] == {"chunk_size": 64, "tiers": [
            {"name": "mooncake", "master": "10.0.0.13:50051", "local_hostname": address}]}
    assert text.index("start the pool first") < text.index("# host")


def test_loopback_keeps_a_mooncake_pools_two_ports_consecutive():
    dep = load_deployment(MOONCAKE)
    place = deploy_run.on_loopback(dep)
    rpc = place.port("node-pool", 50051)
    assert place.port("node-pool", 50052) == rpc + 1
    (master, _store) = deploy_run.pool_processes(dep, place)
    assert f"--rpc_port={rpc}" in master.argv and f"--metrics_port={rpc + 1}" in master.argv
    assert "--rpc_address=127.0.0.1" in master.argv


def _args(*argv: str) -> argparse.Namespace:
    return launcher.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.mark.parametrize("argv, match", [
    (("--netns",), "--netns needs --deploy FILE"),
    (("--print-commands",), "--print-commands needs --deploy FILE"),
])
def test_netns_and_print_commands_need_a_deployment(argv, match):
    with pytest.raises(ValueError, match=match):
        launcher.check_args(_args(*argv))


@pytest.mark.parametrize("argv, match", [
    (("--pool", "redis"), "leave out --pool"),
    (("--mode", "colocated"), "leave out --mode"),
    (("--num-prefill", "2"), "leave out --num-prefill"),
    (("--model", "smollm2-360m"), "leave out --model"),
    (("--", "--num-kv-blocks", "8"), "leave out the flags after --"),
    (("--netns", "--print-commands"), "starts nothing: leave out --netns"),
    (("--transfer-mode", "push"), "leave out --transfer-mode"),
    (("--pool-chunk-size", "64"), "leave out --pool-chunk-size"),
])
def test_deploy_refuses_the_flags_the_file_sets(argv, match, capsys):
    assert deploy_run.main(_args("--deploy", ONE_P_ONE_D, *argv)) == 2
    assert match in capsys.readouterr().err


def test_netns_without_root_is_refused_with_the_reason(monkeypatch, capsys, tmp_path):
    from pdkv.launch import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    args = _args("--deploy", ONE_P_ONE_D, "--netns", "--log-dir", str(tmp_path))
    assert deploy_run.main(args) == 1
    assert "--netns needs root (network namespaces and tc qdiscs)" in capsys.readouterr().err
