"""Starting and stopping the servers of the remote pool tiers."""

from __future__ import annotations

import os

import pytest

from pdkv.launch import services


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a reaped child can't be signalled; an unreaped one is a zombie: check its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_missing_binary_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(services.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(RuntimeError, match="apt-get install -y redis-server"):
        services.start_redis()
    with pytest.raises(RuntimeError, match="mooncake-transfer-engine-non-cuda.*libibverbs1"):
        services.start_mooncake()


def test_bad_segment_size():
    with pytest.raises(ValueError, match="segment_bytes"):
        services.start_mooncake(segment_bytes=0)


def test_redis_service_stops_its_process(own_redis):
    assert own_redis.address.startswith("redis://127.0.0.1:")
    assert own_redis.alive()
    (pid,) = own_redis.pids
    own_redis.stop()
    own_redis.stop()  # idempotent
    assert _gone(pid)
    assert not own_redis.log_dir.exists()


def test_mooncake_service_runs_master_and_store_and_stops_both(own_mooncake):
    host, port = own_mooncake.address.split(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert len(own_mooncake.pids) == 2 and own_mooncake.alive()
    own_mooncake.stop()
    assert all(_gone(p) for p in own_mooncake.pids)
    # the store process closed cleanly on SIGTERM (exit 0), not killed
    assert own_mooncake.procs[1].returncode == 0
