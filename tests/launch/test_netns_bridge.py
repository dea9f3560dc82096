"""NetnsBridge (pdkv/launch/netns.py): hosts as network namespaces on one bridge reach each other
and are reached from this machine at their addresses, a shaped link carries tbf on both ends,
a link delay (netem or pdkv's delay line) holds every packet and loses none, and everything is
removed on exit and after a failed setup. Root only: skips with the reason,
fails under CI=true."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from system_packages import require_reason

from pdkv.launch.delay_line import delay_seconds
from pdkv.launch.netns import (
    LinkShape,
    NetnsBridge,
    delay_method,
    list_namespaces,
    netem_unavailable_reason,
    shape_commands,
    unavailable_reason,
)
from pdkv.procgroup import pid_alive

SERVER = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); s.listen(); "
          "print(s.getsockname()[1], flush=True); c,_=s.accept(); c.sendall(b'ok')")
CLIENT = ("import socket,sys; c=socket.create_connection((sys.argv[1],int(sys.argv[2])),5); "
          "print(c.recv(2).decode())")


def _left(bridge: NetnsBridge) -> list[str]:
    ns = [n for n in list_namespaces() if n.startswith(bridge.run_name + "-")]
    dev = subprocess.run(["ip", "link", "show", bridge.root_dev], capture_output=True)
    return ns + ([bridge.root_dev] if dev.returncode == 0 else [])


def _connect(server_prefix: list[str], address: str, client_prefix: list[str]) -> str:
    server = subprocess.Popen([*server_prefix, sys.executable, "-c", SERVER, address],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        got = subprocess.run([*client_prefix, sys.executable, "-c", CLIENT, address, port],
                             capture_output=True, text=True, timeout=20)
        return got.stdout.strip() or got.stderr
    finally:
        server.kill()
        server.wait(10)


def test_hosts_reach_each_other_and_this_machine_reaches_them():
    require_reason(unavailable_reason())
    with NetnsBridge(["a", "b"], {"a": LinkShape(rate="1gbit")}) as bridge:
        assert sorted(_left(bridge)) == sorted(
            [bridge.switch_ns, bridge.ns("a"), bridge.ns("b"), bridge.root_dev])
        a, b = bridge.address("a"), bridge.address("b")
        assert a.endswith(".1") and b.endswith(".2") and a != b
        assert _connect(bridge.exec_prefix("a"), a, bridge.exec_prefix("b")) == "ok"
        assert _connect(bridge.exec_prefix("b"), b, []) == "ok"  # from the root namespace
        assert "tbf" in bridge.qdiscs("a") and "rate 1Gbit" in bridge.qdiscs("a")
        sw = subprocess.run(["tc", "-n", bridge.switch_ns, "qdisc", "show", "dev", "h0"],
                            capture_output=True, text=True).stdout
        assert "rate 1Gbit" in sw  # the other direction of a's link
        assert "tbf" not in bridge.qdiscs("b")
    assert _left(bridge) == []


def test_a_cut_link_drops_everything_silently_until_restored():
    require_reason(unavailable_reason())
    with NetnsBridge(["a", "b"]) as bridge:
        a = bridge.address("a")
        bridge.cut("a")
        for client in (bridge.exec_prefix("b"), []):  # another host, this machine
            out = _connect(bridge.exec_prefix("a"), a, client)
            # Silence, not a refusal: the connect times out, or ARP gets no answer.
            assert "timed out" in out or "No route to host" in out, out
        bridge.restore("a")
        assert _connect(bridge.exec_prefix("a"), a, bridge.exec_prefix("b")) == "ok"
        assert _connect(bridge.exec_prefix("a"), a, []) == "ok"
    assert _left(bridge) == []


def test_two_runs_do_not_collide():
    require_reason(unavailable_reason())
    with NetnsBridge(["a"]) as one, NetnsBridge(["a"]) as two:
        assert one.run_name != two.run_name and one.subnet != two.subnet
        assert _connect(one.exec_prefix("a"), one.address("a"), []) == "ok"
        assert _connect(two.exec_prefix("a"), two.address("a"), []) == "ok"
    assert _left(one) == [] and _left(two) == []


def test_a_failed_setup_removes_what_it_made():
    require_reason(unavailable_reason())
    bridge = NetnsBridge(["a", "b"], {"b": LinkShape(rate="notarate")})  # tc refuses it
    with pytest.raises(RuntimeError, match="tbf"):
        bridge.setup()
    assert _left(bridge) == []


ECHO_SERVER = r"""
import hashlib, socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(10):
    c.recv(1); c.sendall(b"p")
h, n = hashlib.sha256(), 0
while n < int(sys.argv[2]):
    d = c.recv(1 << 20); h.update(d); n += len(d)
c.sendall(h.hexdigest().encode())
"""
RTT_CLIENT = r"""
import hashlib, os, socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), 20)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(10):
    t = time.monotonic(); c.sendall(b"p"); c.recv(1); rtts.append(time.monotonic() - t)
blob = os.urandom(int(sys.argv[3])); c.sendall(blob)
print(min(rtts), c.recv(64).decode() == hashlib.sha256(blob).hexdigest())
"""


def _rtt_and_integrity(bridge: NetnsBridge, nbytes: int = 8 << 20) -> tuple[float, bool]:
    """Smallest of 10 TCP round trips a → b (s), and whether `nbytes` random bytes a → b
    arrived intact (sha256)."""
    b = bridge.address("b")
    server = subprocess.Popen([*bridge.exec_prefix("b"), sys.executable, "-c", ECHO_SERVER, b,
                               str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        got = subprocess.run([*bridge.exec_prefix("a"), sys.executable, "-c", RTT_CLIENT, b,
                              port, str(nbytes)], capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr
        rtt, intact = got.stdout.split()
        return float(rtt), intact == "True"
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.parametrize("delay_with", ["delay_line", "auto"])
def test_a_delay_holds_every_packet_and_loses_nothing(delay_with):
    """1 ms on a's link and 2 ms on b's, one way per direction: a round trip a → b → a crosses
    each link both ways, so it takes at least 2 × (1 + 2) = 6 ms; a TSO-sized transfer arrives
    intact."""
    require_reason(unavailable_reason())
    links = {"a": LinkShape(rate="1gbit", delay="1ms"), "b": LinkShape(rate="1gbit", delay="2ms")}
    bridge = NetnsBridge(["a", "b"], links, delay_with=delay_with)
    with bridge:
        expected = "delay_line" if delay_with == "delay_line" else delay_method()
        assert bridge.delay_method == expected
        relay = bridge._delay_line
        if expected == "netem":
            assert "netem" in bridge.qdiscs("a") and relay is None
        else:
            assert relay is not None and relay.poll() is None
            assert "by pdkv's delay line" in bridge.link_text("a")
        assert "rate 1Gbit" in bridge.qdiscs("a")
        rtt, intact = _rtt_and_integrity(bridge)
        assert rtt >= 6e-3, rtt
        assert intact
    assert _left(bridge) == []
    if relay is not None:
        assert relay.poll() is not None  # stopped with the run


def test_without_a_delay_the_round_trip_is_short_and_no_delay_line_runs():
    require_reason(unavailable_reason())
    with NetnsBridge(["a", "b"], {"a": LinkShape(rate="1gbit")}) as bridge:
        assert bridge.delay_method is None and bridge._delay_line is None
        rtt, intact = _rtt_and_integrity(bridge, 1 << 20)
        assert rtt < 6e-3 and intact, rtt  # the delayed case's floor, not reached
    assert _left(bridge) == []


def test_netem_asked_for_on_a_kernel_without_it_is_refused_and_leaves_nothing():
    require_reason(unavailable_reason())
    bridge = NetnsBridge(["a"], {"a": LinkShape(delay="1ms")}, delay_with="netem")
    reason = netem_unavailable_reason()
    if reason is None:
        with bridge:
            assert "netem" in bridge.qdiscs("a")
    else:
        with pytest.raises(RuntimeError, match="a link delay with netem cannot be set"):
            bridge.setup()
    assert _left(bridge) == []


def test_the_delay_line_ends_when_the_process_that_started_it_dies(tmp_path):
    """A launcher killed with SIGKILL cannot stop its delay line: the delay line sees its parent
    gone and exits by itself (the namespaces the dead launcher left are removed here)."""
    require_reason(unavailable_reason())
    script = ("import sys, time; from pdkv.launch.netns import LinkShape, NetnsBridge; "
              "b = NetnsBridge(['a'], {'a': LinkShape(delay='1ms')}, delay_with='delay_line'); "
              "b.setup(); print(b.run_name, b._delay_line.pid, flush=True); time.sleep(600)")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    run_name, pid = launcher.stdout.readline().split()
    try:
        assert pid_alive(int(pid))
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 30
        while pid_alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pid_alive(int(pid))
    finally:
        for ns in list_namespaces():
            if ns.startswith(run_name + "-"):
                subprocess.run(["ip", "netns", "del", ns], check=False)
        subprocess.run(["ip", "link", "del", "pdkv" + run_name.split("-")[1]],
                       capture_output=True, check=False)


def test_shaping_commands():
    assert shape_commands("n", "eth0", None, None) == []
    assert shape_commands("n", "eth0", "1gbit", None) == [
        ["tc", "-n", "n", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "1gbit",
         "burst", "64kb", "latency", "100ms"]]
    netem, tbf = shape_commands("n", "eth0", "1gbit", "1ms")
    assert netem[-5:] == ["handle", "1:", "netem", "delay", "1ms"]
    assert tbf[7:11] == ["parent", "1:1", "handle", "10:"]
    assert delay_seconds("250us") == pytest.approx(2.5e-4)
    with pytest.raises(ValueError, match="delay must look like"):
        delay_seconds("1 min")


def test_bad_host_names_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        NetnsBridge(["a", "a"])
    with pytest.raises(ValueError, match="host name"):
        NetnsBridge(["a b"])
