"""NetnsBridge (pdkv/launch/netns.py): hosts as network namespaces on one bridge reach each other
and are reached from this machine at their addresses, a shaped link carries tbf on both ends,
and everything is removed on exit and after a failed setup. Root only: skips with the reason,
fails under CI=true."""

from __future__ import annotations

import subprocess
import sys

import pytest
from system_packages import require_reason

from pdkv.launch.netns import (
    LinkShape,
    NetnsBridge,
    delay_seconds,
    list_namespaces,
    shape_commands,
    unavailable_reason,
)

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


def test_a_delay_uses_netem_or_says_the_kernel_lacks_it():
    require_reason(unavailable_reason())
    bridge = NetnsBridge(["a"], {"a": LinkShape(rate="1gbit", delay="1ms")})
    try:
        bridge.setup()
    except RuntimeError as e:
        assert "this kernel has no netem qdisc" in str(e)
    else:
        assert "netem" in bridge.qdiscs("a") and "tbf" in bridge.qdiscs("a")
    finally:
        bridge.delete()
    assert _left(bridge) == []


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
