"""`pdkv up --mode colocated --num-instances N`: the processes it would start (no model)."""

from __future__ import annotations

import argparse
import json

import pytest

from pdkv.launch import launcher


def _args(*argv: str) -> argparse.Namespace:
    args = launcher.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))
    args.engine_args = [a for a in args.engine_args if a != "--"]
    return args


def test_n_instances_share_the_pool_behind_a_prefix_aware_proxy():
    args = _args("--mode", "colocated", "--num-instances", "3", "--routing", "prefix_aware",
                 "--prefix-aware-max-imbalance", "0.25", "--threads-per-engine", "1")
    launcher.check_args(args)
    topo = launcher.build_topology(args, '{"kv_connector": "KVPoolConnector"}')
    names = [c.name for c in topo.children]
    assert names == ["engine0", "engine1", "engine2", "proxy"]
    engines, proxy = topo.children[:3], topo.children[3]
    for e in engines:  # every instance gets the same pool config
        assert (
            e.cmd[e.cmd.index("--kv-transfer-config") + 1] == '{"kv_connector": "KVPoolConnector"}'
        )
    backends = proxy.cmd[proxy.cmd.index("--backends") + 1].split(",")
    assert backends == [e.url for e in engines]
    assert proxy.cmd[proxy.cmd.index("--routing") + 1] == "prefix_aware"
    assert proxy.cmd[proxy.cmd.index("--tokenizer") + 1] == "smollm2"
    assert proxy.cmd[proxy.cmd.index("--prefix-aware-max-imbalance") + 1] == "0.25"
    assert topo.endpoint == proxy.url


def test_a_colocated_engine_without_a_pool_takes_the_users_kv_transfer_config():
    args = _args(
        "--mode",
        "colocated",
        "--",
        "--kv-transfer-config",
        '{"kv_connector": "OffloadingConnector"}',
    )
    launcher.check_args(args)
    (engine,) = launcher.build_topology(args).children
    assert (
        engine.cmd[engine.cmd.index("--kv-transfer-config") + 1]
        == '{"kv_connector": "OffloadingConnector"}'
    )


def test_one_instance_has_no_proxy():
    args = _args("--mode", "colocated")
    assert [c.name for c in launcher.build_topology(args).children] == ["engine"]


@pytest.mark.parametrize("argv, match", [
    (("--mode", "colocated", "--num-instances", "2", "--pool", "dram"), "disk, redis or mooncake"),
    (("--mode", "pd", "--num-instances", "2"), "--num-instances is for --mode colocated"),
    (("--mode", "colocated", "--num-instances", "0"), ">= 1"),
    (("--mode", "pd", "--", "--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}'),
     "sets the engines' --kv-transfer-config itself"),
    (("--mode", "colocated", "--pool", "disk", "--", "--kv-transfer-config={}"), "leave it out"),
])
def test_refused_combinations(argv, match):
    with pytest.raises(ValueError, match=match):
        launcher.check_args(_args(*argv))


def test_routing_compare_reads_counters_by_label():
    from pdkv.bench.compare.routing import total

    samples = {'pdkv:kv_pool_hit_tokens_total{model_name="m",tier="all"}': 64.0,
               'pdkv:kv_pool_hit_tokens_total{model_name="m",tier="redis"}': 64.0,
               'pdkv:prompt_tokens_total{model_name="m"}': 100.0}
    assert total(samples, "pdkv:kv_pool_hit_tokens_total", tier="all") == 64
    assert total(samples, "pdkv:kv_pool_hit_tokens_total") == 128
    assert total(samples, "pdkv:prompt_tokens_total") == 100


def test_pd_listing_names_role_url_threads_log_and_forwards_disable_log_requests():
    args = _args("--mode", "pd", "--threads-per-engine", "3", "--disable-log-requests")
    topo = launcher.build_topology(args)
    p, d, proxy = topo.children
    p.log_path = "logs/prefill0.log"
    assert (
        p.describe()
        == f"prefill0: prefill (kv_producer), {p.url}, 3 threads, log logs/prefill0.log"
    )
    assert d.describe().startswith(f"decode0: decode (kv_consumer), {d.url}, 3 threads, log ")
    assert proxy.describe().startswith(f"proxy: proxy (P/D, round_robin), {proxy.url}, -, log ")
    assert "--disable-log-requests" in p.cmd and "--disable-log-requests" in d.cmd
    assert (
        "--disable-log-requests"
        not in launcher.build_topology(_args("--mode", "pd")).children[0].cmd
    )


@pytest.mark.parametrize("routing", ["round_robin", "least_loaded", "prefix_aware"])
def test_a_pd_proxy_gets_the_model_as_its_tokenizer_whatever_the_routing(routing):
    """The length check bounds a chat prompt with the model's chat template (no POST /tokenize
    to D for a chat that cannot be too long), so every P/D proxy gets it, once."""
    args = _args("--mode", "pd", "--routing", routing, "--threads-per-engine", "1")
    launcher.check_args(args)
    proxy = launcher.build_topology(args).children[-1]
    assert proxy.name == "proxy"
    assert proxy.cmd.count("--tokenizer") == 1
    assert proxy.cmd[proxy.cmd.index("--tokenizer") + 1] == "smollm2"


@pytest.mark.parametrize("routing", ["kv_aware", "kv_aware_oracle"])
def test_kv_routing_turns_the_engines_kv_events_on(routing):
    for mode in (("--mode", "colocated", "--num-instances", "2"), ("--mode", "pd")):
        args = _args(*mode, "--routing", routing)
        launcher.check_args(args)
        topo = launcher.build_topology(args)
        engines = [c for c in topo.children if c.name != "proxy"]
        assert engines
        for e in engines:
            cfg = json.loads(e.cmd[e.cmd.index("--kv-events-config") + 1])
            assert cfg["enable_kv_cache_events"] and cfg["endpoint"] == "tcp://127.0.0.1:0"
        proxy = topo.children[-1]
        assert proxy.cmd[proxy.cmd.index("--routing") + 1] == routing
    plain = launcher.build_topology(_args("--mode", "colocated", "--num-instances", "2"))
    assert all("--kv-events-config" not in c.cmd for c in plain.children)


@pytest.mark.parametrize("transfer", ["tcp", "shm", "mooncake"])
def test_pd_transfer_mode_push_reaches_both_engines_connector_config(transfer):
    args = _args("--mode", "pd", "--transfer-mode", "push", "--kv-transfer", transfer)
    launcher.check_args(args)
    topo = launcher.build_topology(args)
    modes = {}
    for child in topo.children:
        if "--kv-transfer-config" in child.cmd:
            cfg = json.loads(child.cmd[child.cmd.index("--kv-transfer-config") + 1])
            modes[cfg["kv_role"]] = cfg["kv_connector_extra_config"].get("transfer_mode")
    assert modes == {"kv_producer": "push", "kv_consumer": "push"}
    assert all(f'"transfer": "{transfer}"' in " ".join(c.cmd) for c in topo.children[:-1])
    assert topo.children[-1].describe().startswith("proxy: proxy (P/D push, round_robin)")
    pull = launcher.build_topology(_args("--mode", "pd"))
    assert all('"transfer_mode"' not in " ".join(c.cmd) for c in pull.children)


def test_pd_push_with_a_pool_puts_the_push_child_in_each_multiconnector():
    args = _args("--mode", "pd", "--transfer-mode", "push", "--pool", "disk")
    launcher.check_args(args)
    from pdkv.router.pool_topology import pool_kv_transfer_config, pool_tier_spec

    topo = launcher.build_topology(args, pool_kv_transfer_config(pool_tier_spec("disk", None)))
    orders = {}
    for child in topo.children:
        if "--kv-transfer-config" in child.cmd:
            cfg = json.loads(child.cmd[child.cmd.index("--kv-transfer-config") + 1])
            assert cfg["kv_connector"] == "MultiConnector"
            kids = cfg["kv_connector_extra_config"]["connectors"]
            orders[cfg["kv_role"]] = [
                (k["kv_connector"], k["kv_connector_extra_config"].get("transfer_mode"))
                for k in kids]
    # P answers with the P2P child's params (first child wins); D loads from the pool first.
    assert orders == {"kv_producer": [("P2PConnector", "push"), ("KVPoolConnector", None)],
                      "kv_consumer": [("KVPoolConnector", None), ("P2PConnector", "push")]}


@pytest.mark.parametrize("argv, match", [
    (("--mode", "colocated", "--transfer-mode", "push"), "is for --mode pd"),
])
def test_push_refuses_what_it_does_not_take(argv, match):
    with pytest.raises(ValueError, match=match):
        launcher.check_args(_args(*argv))
