"""NetnsPair creates two namespaces joined by a rate-capped veth pair and removes all of it (also
after a failed setup and when stale names are left). Needs root and iproute2."""

from __future__ import annotations

import subprocess

import pytest

from pdkv.bench.netns import NetnsPair
from pdkv.launch.netns import list_namespaces, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"network namespaces: {unavailable_reason()}")

PREFIX = "pdkvtst"  # not the benchmark's prefix, so a running benchmark is left alone


def _ours() -> set[str]:
    return {n for n in list_namespaces() if n.startswith(PREFIX + "-")}


def test_pair_connects_caps_and_is_removed():
    stale = NetnsPair(PREFIX)
    subprocess.run(["ip", "netns", "add", stale.ns("p")], check=True)  # left by a crashed run
    with NetnsPair(PREFIX, rate="1gbit") as pair:
        assert _ours() == {pair.ns("p"), pair.ns("d")}
        assert "tbf" in pair.qdisc("p") and "rate 1Gbit" in pair.qdisc("d")
        # D's namespace reaches P's address over the veth pair (a TCP connect, no ping needed).
        code = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); s.listen(); "
                "print(s.getsockname()[1], flush=True); c,_=s.accept(); c.sendall(b'ok')")
        server = subprocess.Popen(pair.exec_prefix("p") + ["python3", "-c", code, pair.host("p")],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            client = (
                "import socket,sys; c=socket.create_connection((sys.argv[1],int(sys.argv[2])),5); "
                "print(c.recv(2).decode())"
            )
            got = subprocess.run(
                pair.exec_prefix("d") + ["python3", "-c", client, pair.host("p"), port],
                capture_output=True,
                text=True,
                timeout=20,
            )
            assert got.stdout.strip() == "ok", got.stderr
        finally:
            server.kill()
            server.wait(10)
    assert _ours() == set()
    assert (
        subprocess.run(["ip", "link", "show", pair.dev("p")], capture_output=True).returncode != 0
    )


def test_failed_setup_removes_what_it_made():
    with pytest.raises(RuntimeError, match="tbf"):
        NetnsPair(PREFIX, rate="1gbit", burst="notasize").setup()
    assert _ours() == set()
