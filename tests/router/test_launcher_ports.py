"""`pdkv up --mode pd` port choice (pdkv/router/launcher.py): a producer at tp N listens on
kv_port + r and transfer_port + r for its ranks r, so the launcher hands out N consecutive free
ports for each and no other child gets one of them. Torch-free, no process started."""

from __future__ import annotations

import argparse
import json
import socket

from pdkv.router import launcher


def test_a_tp2_prefill_engine_gets_two_consecutive_ports_no_other_child_uses(monkeypatch):
    import itertools
    import random

    counter = itertools.count()  # candidate ports in order, so that neighbours are tried first
    monkeypatch.setattr(random, "randint", lambda low, high: low + next(counter) % (high - low + 1))
    parser = launcher.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--mode", "pd", "--num-prefill", "2", "--", "--tensor-parallel-size", "2"])
    assert launcher.engine_world_size(args.engine_args) == 2
    topo = launcher.build_topology(args)
    taken: list[int] = []
    for child in topo.children:
        taken.append(int(child.cmd[child.cmd.index("--port") + 1]))
        if "--kv-transfer-config" in child.cmd:
            extra = json.loads(child.cmd[child.cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
            for key in ("kv_port", "transfer_port"):
                if key in extra:
                    taken += [extra[key], extra[key] + 1]  # ranks 0 and 1
    assert sum("kv_port" in " ".join(c.cmd) for c in topo.children) == 2  # both producers
    assert len(taken) == len(set(taken)), f"a port is handed out twice: {sorted(taken)}"
    assert launcher.engine_world_size(["-tp", "4"]) == 4 and launcher.engine_world_size([]) == 1


def test_a_run_of_free_ports_skips_a_bound_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        busy = s.getsockname()[1]
        taken = {busy - 2, busy + 1}  # leaves only runs that would cover `busy`, if any, near it
        port = launcher.free_port(taken, low=busy - 1, high=busy + 3, count=2)
        assert port == busy + 2 and {busy + 2, busy + 3} <= taken
