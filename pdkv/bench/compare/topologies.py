"""The topologies `pdkv compare` knows (names → specs) and how each becomes `pdkv up` arguments."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from pdkv.launch import launcher

DEFAULT_TOPOLOGIES = "colocated,pd,pd+pool,pd+pool+skip,colocated+pool"
QUICK_TOPOLOGIES = "colocated,pd"

_TOPOLOGY_RE = re.compile(r"^(colocated|pd)(\d*)(\+pool)?(\+skip)?(\+offload)?$")
# colocated+offload: the engine's KV cache is cut to this many blocks so the workload's prompts
# (6 x 1024 tokens = 384 blocks by default) do not fit and the host store serves the hot run.
OFFLOAD_NUM_KV_BLOCKS = 160
OFFLOAD_CPU_BYTES = 4 << 30


@dataclass(frozen=True)
class TopologySpec:
    """One topology to compare: `mode` as in `pdkv up --mode`, `pool` whether engines get the KV
    pool, `instances` colocated engines behind the proxy (1 = a single engine, no proxy),
    `skip_prefill` the proxy's `--skip-prefill-on-pool-hit` (P/D + pool only), `offload` a CPU
    offload host store, `link_rate` (tc syntax) P behind a capped link
    (pdkv.bench.compare.netns)."""

    name: str
    mode: str
    pool: bool
    instances: int = 1
    skip_prefill: bool = False
    offload: bool = False
    link_rate: str | None = None


def parse_topologies(text: str) -> list[TopologySpec]:
    """"colocated,pd,pd+pool,colocated2+pool" -> specs. Raises ValueError on an unknown name,
    a duplicate, or an instance count on `pd` (1P1D only)."""
    specs: list[TopologySpec] = []
    for name in (t.strip() for t in text.split(",")):
        if not name:
            continue
        m = _TOPOLOGY_RE.match(name)
        if m is None:
            raise ValueError(
                f"unknown topology {name!r}: use colocated, pd, pd+pool, pd+pool+skip "
                "(the proxy skips P on a pool hit), colocated+pool or colocatedN[+pool] "
                "(N instances behind the routing proxy)"
            )
        mode, count, pool, skip = m.group(1), m.group(2), bool(m.group(3)), bool(m.group(4))
        offload = bool(m.group(5))
        if offload and (mode != "colocated" or count or pool or skip):
            raise ValueError(
                f"topology {name!r}: +offload is for one colocated engine (colocated+offload)"
            )
        if mode == "pd" and count:
            raise ValueError(f"topology {name!r}: pd is 1P1D here; no instance count")
        if skip and not (mode == "pd" and pool):
            raise ValueError(f"topology {name!r}: +skip (skip P on a pool hit) is for pd+pool only")
        instances = int(count) if count else 1
        if instances < 1:
            raise ValueError(f"topology {name!r}: at least 1 instance")
        if any(s.name == name for s in specs):
            raise ValueError(f"topology {name!r} given twice")
        specs.append(TopologySpec(name, mode, pool, instances, skip, offload))
    if not specs:
        raise ValueError("--topologies is empty")
    return specs


def launcher_has(dest: str) -> bool:
    """Whether `pdkv up` has the flag stored as `dest` (e.g. "num_instances")."""
    return hasattr(launcher.add_cli_args(argparse.ArgumentParser()).parse_args([]), dest)


def unsupported_reason(spec: TopologySpec, pool_tier: str, instances_ok: bool,
                       skip_ok: bool = True) -> str | None:
    """Why `spec` cannot run here (None when it can); `instances_ok` / `skip_ok`: whether the
    launcher has `--num-instances` / `--skip-prefill-on-pool-hit`."""
    if spec.instances > 1 and not instances_ok:
        return ("needs `pdkv up --mode colocated --num-instances N` (N engines behind the routing "
                "proxy), which this launcher does not have yet")
    if spec.skip_prefill and not skip_ok:
        return "needs `pdkv up --skip-prefill-on-pool-hit`, which this launcher does not have yet"
    if spec.pool and pool_tier == "dram" and (spec.mode == "pd" or spec.instances > 1):
        return "a dram pool lives inside one process; use --pool-tier disk, redis or mooncake"
    return None


def launcher_args(spec: TopologySpec, args: argparse.Namespace, log_dir: str) -> argparse.Namespace:
    """The `pdkv up` namespace for `spec` (launcher defaults for everything not set here)."""
    argv = ["--mode", spec.mode, "--model", args.model, "--kv-transfer", args.kv_transfer,
            "--log-dir", log_dir, "--threads-per-engine", str(args.threads_per_engine)]
    if spec.instances > 1:
        argv += ["--num-instances", str(spec.instances), "--routing", args.routing]
    if spec.skip_prefill:
        argv += ["--skip-prefill-on-pool-hit"]
    ns = launcher.add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    ns.engine_args = list(args.engine_args)
    return ns


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag value` set (replacing an earlier value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        out.append(a)
    return out + [flag, value]
