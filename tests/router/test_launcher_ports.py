"""`pdkv up --mode pd` port choice (pdkv/launch/launcher.py): a producer at tp N listens on
kv_port + r and transfer_port + r for its ranks r, so the launcher hands out N consecutive free
ports for each and no other child gets one of them. Torch-free, no process started."""

from __future__ import annotations

import argparse
import json
import types

import pytest

from pdkv import ports
from pdkv.launch import launcher


def test_a_tp2_prefill_engine_gets_two_consecutive_ports_no_other_child_uses(monkeypatch):
    import itertools
    import random

    counter = itertools.count()  # candidate ports in order, so that neighbours are tried first
    monkeypatch.setattr(random, "randint", lambda low, high: low + next(counter) % (high - low + 1))
    parser = launcher.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--mode", "pd", "--num-prefill", "2", "--", "--tensor-parallel-size", "2"]
    )
    assert launcher.engine_world_size(args.engine_args) == 2
    topo = launcher.build_topology(args)
    taken: list[int] = []
    for child in topo.children:
        taken.append(int(child.cmd[child.cmd.index("--port") + 1]))
        if "--kv-transfer-config" in child.cmd:
            extra = json.loads(child.cmd[child.cmd.index("--kv-transfer-config") + 1])[
                "kv_connector_extra_config"
            ]
            for key in ("kv_port", "transfer_port"):
                if key in extra:
                    taken += [extra[key], extra[key] + 1]  # ranks 0 and 1
    assert sum("kv_port" in " ".join(c.cmd) for c in topo.children) == 2  # both producers
    assert len(taken) == len(set(taken)), f"a port is handed out twice: {sorted(taken)}"
    assert launcher.engine_world_size(["-tp", "4"]) == 4 and launcher.engine_world_size([]) == 1


class _FakeSocket:
    """Stands in for socket.socket in the launcher: bind fails for the ports in `busy` (bound by
    another process), succeeds for every other one, and binds nothing for real, so the test does
    not depend on what else holds ports on the machine."""

    busy: set[int] = set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, addr):
        if addr[1] in self.busy:
            raise OSError(98, "Address already in use")


def test_a_run_of_free_ports_skips_a_bound_one(monkeypatch):
    import itertools
    import random

    monkeypatch.setattr(ports, "socket", types.SimpleNamespace(socket=_FakeSocket))
    down = (
        itertools.count()
    )  # candidates from the top down, so 21001 (next to the bound 21002) comes first
    monkeypatch.setattr(random, "randint", lambda low, high: high - next(down) % (high - low + 1))
    _FakeSocket.busy = {21002}
    taken = {20999, 21003}  # handed out already; with 21002 bound only 21000-21001 is a free run
    port = ports.free_port(taken, low=20999, high=21004, count=2)
    assert port == 21000 and {21000, 21001} <= taken
    _FakeSocket.busy = {21000}  # now the only run left, 21004-21005, lies past `high`
    with pytest.raises(RuntimeError, match="no 2 free consecutive"):
        ports.free_port({20999, 21003, 21001}, low=20999, high=21004, count=2)
