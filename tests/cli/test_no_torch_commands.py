"""`pdkv up` (the launcher) and `pdkv proxy` never import torch (~300 MB of resident memory they
do not use): their modules, and the `pdkv` entry point parsing and running each command up to
the point where it would start processes or serve (the topology is built, the proxy app too)."""

from __future__ import annotations

import os
import subprocess
import sys

# Runs in a fresh interpreter: stops the launcher before it starts children (start_healthy) and
# the proxy before it serves (uvicorn.run), then lists the torch modules loaded.
CHILD = """
import sys
import uvicorn
import pdkv.launch.demo, pdkv.launch.launcher as launcher, pdkv.router.proxy, pdkv.router.proxy_cli
from pdkv import cli

ran = []


def start_healthy(self, log_dir, timeout):
    ran.append(len(self.children))
    return False


launcher.Topology.start_healthy = start_healthy
uvicorn.run = lambda app, **kw: ran.append(type(app).__name__)
log_dir = sys.argv[1]
assert cli.main(["up", "--mode", "pd", "--log-dir", log_dir, "--", "--num-kv-blocks", "64"]) == 1
assert cli.main(["up", "--mode", "colocated", "--num-instances", "2", "--routing", "prefix_aware",
                 "--log-dir", log_dir]) == 1
assert cli.main(["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                 "--routing", "least_loaded", "--port", "1"]) == 0
print("ran", ran)
print("torch modules", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_up_and_proxy_run_without_importing_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=os.getcwd(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ran [3, 3, 'FastAPI']" in out.stdout, (
        out.stdout
    )  # both topologies built, the proxy app too
    assert "torch modules []" in out.stdout, out.stdout
