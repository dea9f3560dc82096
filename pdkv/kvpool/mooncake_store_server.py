"""The Mooncake Store process that holds the pool's memory.

`mooncake_master` only keeps metadata; objects live in segments that clients mount, and a
client's clean close drops every object in its segment. Engines therefore connect as pure
clients (segment 0) and this process mounts the memory and stays up while they come and go.

    python -m pdkv.kvpool.mooncake_store_server --master 127.0.0.1:50051 --segment-bytes 536870912

Prints one line "ready" on stdout once its segment is mounted, runs until SIGTERM or SIGINT (or
until --parent-pid exits), then closes the client (unmounting the segment) and exits 0.
Exit code 2 = bad arguments or mooncake missing, 1 = setup failed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from pdkv.procgroup import pid_alive


def main(argv: list[str] | None = None) -> int:
    """Run the store process; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", required=True, help="mooncake_master RPC address HOST:PORT")
    ap.add_argument("--segment-bytes", type=int, required=True, help="memory to mount, bytes")
    ap.add_argument("--local-buffer-bytes", type=int, default=16 << 20, help="client buffer, bytes")
    ap.add_argument("--local-hostname", default="127.0.0.1", help="address peers reach us on")
    ap.add_argument("--protocol", default="tcp", help="transfer protocol (tcp or rdma)")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    args = ap.parse_args(argv)
    if args.segment_bytes <= 0:
        print(f"--segment-bytes must be > 0, got {args.segment_bytes}", file=sys.stderr)
        return 2
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        print(
            f"cannot import mooncake.store ({e}): `pip install mooncake-transfer-engine-non-cuda` "
            "and `apt-get install -y libibverbs1`",
            file=sys.stderr,
        )
        return 2

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    store = MooncakeDistributedStore()
    rc = store.setup(
        args.local_hostname,
        "P2PHANDSHAKE",
        args.segment_bytes,
        args.local_buffer_bytes,
        args.protocol,
        "",
        args.master,
    )
    if rc != 0:
        print(f"mooncake setup against {args.master} failed with code {rc}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    while not stop.wait(1.0):
        if args.parent_pid and not pid_alive(args.parent_pid):
            break
    rc = store.close()
    print(f"closed {rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
