"""`pdkv compare --link-rate 1gbit`: P/D with P behind a rate-capped link (pdkv.bench.netns).

The run creates two network namespaces joined by a veth pair whose ends carry a tbf qdisc at the
rate (`NetnsPair`, the same as `pdkv bench handoff --link-rate`), then runs the whole comparison
again as a child process inside D's namespace (`ip netns exec <prefix>-d pdkv compare
--netns-inner <prefix> ...`): the client, the proxy, D and every other topology live there on
its loopback, beside D. The capped topology (`pd@<rate>`) starts its prefill engines inside P's
namespace (`ip netns exec <prefix>-p`), bound to and advertising P's veth address
(`--host`, kv_host / kv_advertise_host), so the proxy → P requests and D's KV pull cross the
capped link. The namespaces are deleted when the child exits (also on Ctrl-C / SIGTERM).
Without root or iproute2 the capped topology is skipped with a message.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence

from pdkv.bench.netns import NetnsPair
from pdkv.launch import launcher

NETNS_PREFIX = "pdkvc"


def capped_name(rate: str) -> str:
    """The topology name of P/D over a link capped at `rate` ("pd@1gbit")."""
    return f"pd@{rate}"


def inner_argv(python: str, compare_args: Sequence[str], prefix: str) -> list[str]:
    """argv of the child run inside D's namespace: `compare_args` are the flags after
    `pdkv compare` (engine flags after `--` stay last)."""
    return [python, "-m", "pdkv.cli", "compare", "--netns-inner", prefix, *compare_args]


def strip_inner(compare_args: Sequence[str]) -> list[str]:
    """`compare_args` without `--netns-inner PREFIX` (the command the user typed)."""
    out, skip = [], False
    for a in compare_args:
        if skip:
            skip = False
            continue
        if a == "--netns-inner":
            skip = True
            continue
        if a.startswith("--netns-inner="):
            continue
        out.append(a)
    return out


def _with_kv_host(cfg: dict[str, object], host: str) -> dict[str, object]:
    """A P2PConnector config (or a MultiConnector holding one) with kv_host and
    kv_advertise_host set to `host`."""
    extra = dict(cfg.get("kv_connector_extra_config") or {})  # type: ignore[call-overload]
    if cfg.get("kv_connector") == "MultiConnector":
        extra["connectors"] = [_with_kv_host(c, host) for c in extra.get("connectors", [])]
    elif cfg.get("kv_connector") == "P2PConnector":
        extra.update(kv_host=host, kv_advertise_host=host)
    return dict(cfg, kv_connector_extra_config=extra)


def _set_flag(cmd: list[str], flag: str, value: str) -> None:
    i = cmd.index(flag)
    cmd[i + 1] = value


def cap_topology(topo: launcher.Topology, pair: NetnsPair) -> None:
    """Move the prefill engines of a built P/D topology into P's namespace (in place): each
    `prefill*` child runs under `ip netns exec <prefix>-p`, binds `--host` to P's address and
    advertises it for its KV; its URL and the proxy's `--prefill` list point there.

    Raises:
        ValueError: the topology has no prefill engine or no proxy.
    """
    host = pair.host("p")
    moved: dict[str, str] = {}
    for c in topo.children:
        if not c.name.startswith("prefill"):
            continue
        new_url = c.url.replace("127.0.0.1", host)
        moved[c.url] = new_url
        cmd = list(c.cmd)
        _set_flag(cmd, "--host", host)
        i = cmd.index("--kv-transfer-config")
        cmd[i + 1] = json.dumps(_with_kv_host(json.loads(cmd[i + 1]), host))
        c.cmd = pair.exec_prefix("p") + cmd
        c.url = new_url
    proxies = [c for c in topo.children if c.name == "proxy"]
    if not moved or not proxies:
        raise ValueError("cap_topology needs a P/D topology (prefill engines and a proxy)")
    cmd = proxies[0].cmd
    i = cmd.index("--prefill")
    cmd[i + 1] = ",".join(moved.get(u, u) for u in cmd[i + 1].split(","))


def run_inside(
    python: str, compare_args: Sequence[str], rate: str, prefix: str = NETNS_PREFIX
) -> int:
    """Create the capped namespace pair, run the comparison inside D's namespace, delete the
    pair; returns the child's exit code.

    Raises:
        RuntimeError: the namespaces could not be made (not root, no iproute2, an ip/tc error).
    """
    with NetnsPair(prefix=prefix, rate=rate) as pair:
        print(
            f"namespaces {pair.ns('p')} ({pair.host('p')}) and {pair.ns('d')} ({pair.host('d')}): "
            f"{pair.qdisc('p')}",
            flush=True,
        )
        proc = subprocess.Popen(pair.exec_prefix("d") + inner_argv(python, compare_args, prefix))
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
