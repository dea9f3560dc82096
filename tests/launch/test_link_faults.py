"""Link faults on a live deployment (`pdkv up --deploy FILE --netns`, tiny-llama-kv2): the test
takes one host's link down (`pdkv.launch.netns.set_link`: the host's veth end on the bridge goes
down, so every packet to or from it is dropped and open connections see only silence) and brings
it back, then checks that the request in flight ends in bounded time as the design says, that
every engine's blocks are free again, what the proxy's /health shows, and that the deployment
serves again without a restart.

1. D's link down during a pull (P's link shaped so the pull of a 480-token prompt takes seconds;
   cut once D reports the request waiting for remote KV): P frees its blocks at its lease, D
   gives up at its transfer deadline (`fail`: the client gets an error; `recompute`: D
   recomputes and the client gets the colocated text once the link is back).
2. The link of one of two D's down while it streams: the client's stream ends with an error
   within the proxy's timeout, the proxy's /health shows that D down (and the other one up),
   new requests go to the other D; back up: both serve again.
3. The pool host down (redis on its own host): requests are pool misses, not errors, and answer
   as colocated; back up: P writes chunks again and D hits them.

Root only (network namespaces): skips with the reason, fails under CI=true."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from deploy_harness import Up, complete, metric, wait_metric
from system_packages import require_reason

from pdkv import LLM, SamplingParams
from pdkv.launch.netns import list_namespaces, set_link, unavailable_reason

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

NUM_KV_BLOCKS = 64
MAX_TOKENS = 8
LONG = [(i * 7919 + 13) % 40000 + 100 for i in range(480)]  # 30 blocks, ~1 MB of KV
SHORT = [(i * 104729 + 7) % 40000 + 100 for i in range(80)]  # 2 pool chunks of 32
LONG_KV_BYTES = 30 * 16 * 4 * 2 * 2 * 32 * 4  # blocks x block size x layers x (K, V) x heads
# x head size x float32
LEASE_S = 3.0  # P's kv_lease_duration
TRANSFER_TIMEOUT_S = 6.0  # D's transfer_timeout
FREE = "pdkv:num_free_blocks"

HEAD = """\
model = "tiny-llama-kv2"
engine_args = ["--num-kv-blocks", "64", "--max-model-len", "512"]
"""


@pytest.fixture(scope="module")
def references(tiny_llama_kv2) -> dict[str, str]:
    """The colocated engine's greedy texts of LONG and SHORT."""
    llm = LLM(tiny_llama_kv2, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=512)
    try:
        out = llm.generate([{"prompt_token_ids": LONG}, {"prompt_token_ids": SHORT}],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.llm_engine.shutdown()
    return {"long": out[0].outputs[0].text, "short": out[1].outputs[0].text}


class Run:
    """A started deployment in namespaces: its run name, host order and URLs."""

    def __init__(self, up: Up, hosts: list[str]) -> None:
        self.up = up
        self.name = up.wait_for(r"^namespaces of (pdkv-[0-9a-f]{6}) on ").group(1)
        self.hosts = hosts
        self.endpoint = up.wait_for(r"^ready: (http://\S+)").group(1)

    def cut(self, host: str) -> None:
        set_link(self.name, self.hosts.index(host), up=False)

    def restore(self, host: str) -> None:
        set_link(self.name, self.hosts.index(host), up=True)

    def health(self) -> tuple[int, dict[str, bool]]:
        """The proxy's GET /health: its status and {role + index: healthy}."""
        r = httpx.get(self.endpoint + "/health", timeout=30)
        seen: dict[str, int] = {}
        out = {}
        for b in r.json()["backends"]:
            i = seen[b["role"]] = seen.get(b["role"], -1) + 1
            out[f"{b['role']}{i}"] = b["healthy"]
        return r.status_code, out


@contextmanager
def deployment(tmp_path, cache: str, text: str, hosts: list[str]) -> Iterator[Run]:
    dep = tmp_path / "dep.toml"
    dep.write_text(text)
    up = Up(tmp_path, cache, "--netns", deploy=str(dep))
    run = None
    try:
        run = Run(up, hosts)
        yield run
        assert up.proc.poll() is None, f"pdkv up exited (a process died):\n{up.text()}"
        assert " exited" not in up.text(), up.text()  # no engine restarted or died
    finally:
        if run is not None:
            for h in hosts:  # a failed assertion must not leave a link down for the teardown
                run.restore(h)
        rc = up.stop()
    assert rc == 0, up.text()
    if run is not None:
        assert [n for n in list_namespaces() if n.startswith(run.name + "-")] == []


class Request(threading.Thread):
    """One completion through the proxy in a thread: its status, body and seconds taken."""

    def __init__(self, endpoint: str, prompt: list[int], max_tokens: int = MAX_TOKENS,
                 stream: bool = False) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.prompt, self.max_tokens, self.stream = (
            endpoint, prompt, max_tokens, stream)
        self.status: int | None = None
        self.body = ""
        self.error: str | None = None
        self.seconds = 0.0
        self.start()

    def run(self) -> None:
        t0 = time.monotonic()
        body = {"model": "tiny-llama-kv2", "prompt": self.prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": self.stream}
        try:
            with httpx.stream("POST", self.endpoint + "/v1/completions", json=body,
                              timeout=120) as r:
                self.status = r.status_code
                for chunk in r.iter_text():
                    self.body += chunk
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.monotonic() - t0

    def result(self, timeout: float) -> Request:
        self.join(timeout)
        assert not self.is_alive(), f"the request still hangs after {timeout} s"
        return self


def wait_until(what: str, check, timeout: float, every: float = 0.05) -> float:
    """Seconds until `check()` is true; fails naming `what` after `timeout`."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(every)
    return time.monotonic() - t0


def one_p_one_d(policy: str) -> str:
    return HEAD + f"""\
kv_load_failure_policy = "{policy}"
kv_lease_duration = {LEASE_S}
transfer_timeout = {TRANSFER_TIMEOUT_S}

[hosts.node-p]
address = "10.0.0.11"
link = {{ rate = "3mbit" }}   # the 480-token prompt's ~1 MB pull takes ~3 s

[hosts.node-d]
address = "10.0.0.12"

[hosts.node-proxy]
address = "10.0.0.13"

[[prefill]]
host = "node-p"
port = 8100

[[decode]]
host = "node-d"
port = 8100

[proxy]
host = "node-proxy"
port = 8000
timeout = 40                  # above the cut, so D's own answer gets through after it
health_check_interval = 1
"""


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_d_link_down_during_a_pull(tmp_path, tiny_llama_cache, references, policy):
    """P frees at its lease while D is cut off; D gives up at its transfer deadline; the client
    gets an error (fail) or the colocated text (recompute) once D's link is back."""
    require_reason(unavailable_reason())
    hosts = ["node-p", "node-d", "node-proxy"]
    with deployment(tmp_path, tiny_llama_cache, one_p_one_d(policy), hosts) as run:
        p, d = run.up.url("prefill0"), run.up.url("decode0")
        req = Request(run.endpoint, LONG)
        wait_until("D waits for P's KV", lambda: metric(
            d, "pdkv:num_requests_waiting_for_remote_kv") >= 1, 30)
        run.cut("node-d")
        t_cut = time.monotonic()
        # D cannot release P's blocks nor renew their lease: P frees them when it ends.
        wait_until("P's blocks back at its lease",
                   lambda: metric(p, FREE) == NUM_KV_BLOCKS, LEASE_S + 10, every=0.2)
        assert metric(p, "pdkv:kv_lease_expirations_total") == 1
        # The proxy's probe of D times out (probe every 1 s, its timeout 5 s: backend_health's
        # default), which may come after P's lease (3 s): wait for it, bounded.
        wait_until("the proxy marks D down", lambda: run.health()[0] == 503, 15, every=0.2)
        status, backends = run.health()
        assert status == 503 and backends == {"prefill0": True, "decode0": False}, backends
        # Past D's transfer deadline (stamped before the cut) before the link comes back.
        time.sleep(max(0.0, t_cut + TRANSFER_TIMEOUT_S + 1 - time.monotonic()))
        assert req.is_alive()  # nothing reached the client while D was cut off
        run.restore("node-d")
        t_back = time.monotonic()
        req.result(45)
        assert req.error is None, req.error
        # D gave up at its own deadline, while cut off (not when P refused a late read).
        deadline = "transfer deadline passed"
        if policy == "fail":
            assert req.status == 500 and deadline in req.body, (req.status, req.body)
        else:
            assert req.status == 200, req.body
            assert references["long"] in req.body
            assert deadline in (tmp_path / "logs" / "decode0.log").read_text()
        assert time.monotonic() - t_back < 20  # D's answer, resent once the link is back
        assert metric(d, "pdkv:kv_load_failures_total", f'policy="{policy}"') == 1
        assert wait_metric(d, FREE, NUM_KV_BLOCKS, timeout=10) == NUM_KV_BLOCKS
        wait_until("the proxy sees D healthy again", lambda: run.health()[0] == 200, 20, 0.5)
        # The same deployment serves again: a whole pull over the link that was cut (both
        # prefix caches reset, so D pulls every block P computed).
        assert httpx.post(run.endpoint + "/reset_prefix_cache", timeout=30).status_code == 200
        received = metric(d, "pdkv:kv_transfer_bytes_received_total")
        assert complete(run.endpoint, LONG)[0] == references["long"]
        assert metric(d, "pdkv:kv_transfer_bytes_received_total") - received == LONG_KV_BYTES
        for url in (p, d):
            assert wait_metric(url, FREE, NUM_KV_BLOCKS) == NUM_KV_BLOCKS


TWO_D = HEAD + """\
[hosts.node-p]
address = "10.0.0.11"

[hosts.node-d0]
address = "10.0.0.12"

[hosts.node-d1]
address = "10.0.0.13"

[hosts.node-proxy]
address = "10.0.0.14"

[[prefill]]
host = "node-p"
port = 8100

[[decode]]
host = "node-d0"
port = 8100

[[decode]]
host = "node-d1"
port = 8100

[proxy]
host = "node-proxy"
port = 8000
timeout = 4                   # a leg silent this long fails (and marks its engine down)
health_check_interval = 1
"""
PROXY_TIMEOUT_S = 4.0
STREAM_TOKENS = 400


def test_proxy_link_to_one_of_two_d_down(tmp_path, tiny_llama_cache, references):
    """The stream in flight on the cut D ends with an error within the proxy's timeout; the
    proxy's /health shows that D down and routes to the other; back up, both serve again."""
    require_reason(unavailable_reason())
    hosts = ["node-p", "node-d0", "node-d1", "node-proxy"]
    with deployment(tmp_path, tiny_llama_cache, TWO_D, hosts) as run:
        p = run.up.url("prefill0")
        ds = [run.up.url("decode0"), run.up.url("decode1")]
        req = Request(run.endpoint, SHORT, max_tokens=STREAM_TOKENS, stream=True)
        busy: list[int] = []

        def streaming() -> bool:
            busy[:] = [i for i, d in enumerate(ds)
                       if metric(d, "pdkv:num_requests_running") >= 1]
            return bool(busy) and '"text"' in req.body

        wait_until("a D streams the request", streaming, 30)
        (k,) = busy
        run.cut(hosts[1 + k])
        t_cut = time.monotonic()
        req.result(PROXY_TIMEOUT_S + 20)
        assert time.monotonic() - t_cut < PROXY_TIMEOUT_S + 10
        # The proxy ends the stream with an error event (the stream had started: 200 sent).
        assert req.error is None and req.status == 200, (req.error, req.status)
        assert '"code": 502' in req.body and "decode stream failed" in req.body, req.body[-500:]
        assert req.body.count('"text"') < STREAM_TOKENS, "the stream finished as if not cut"
        status, backends = run.health()
        want = {"prefill0": True, "decode0": k != 0, "decode1": k != 1}
        assert status == 503 and backends == want, backends
        served = metric(ds[1 - k], "pdkv:request_success_total")
        for _ in range(2):  # both to the D that is up
            assert complete(run.endpoint, SHORT)[0] == references["short"]
        assert metric(ds[1 - k], "pdkv:request_success_total") - served == 2
        run.restore(hosts[1 + k])
        wait_until("the proxy sees every engine healthy", lambda: run.health()[0] == 200, 20,
                   0.5)
        served = metric(ds[k], "pdkv:request_success_total")
        for _ in range(2):  # round robin: one of them on the D that was cut
            assert complete(run.endpoint, SHORT)[0] == references["short"]
        assert metric(ds[k], "pdkv:request_success_total") - served >= 1
        for url in (p, *ds):
            assert wait_metric(url, FREE, NUM_KV_BLOCKS) == NUM_KV_BLOCKS, url


POOL = HEAD + """\
[hosts.node-p]
address = "10.0.0.11"

[hosts.node-d]
address = "10.0.0.12"

[hosts.node-pool]
address = "10.0.0.13"

[[prefill]]
host = "node-p"
port = 8100

[[decode]]
host = "node-d"
port = 8100

[proxy]
host = "node-d"
port = 8000

[pool]
service = "redis"
host = "node-pool"
port = 6379
chunk_size = 32
"""
REDIS = 'tier="redis"'
CHUNKS = len(SHORT) // 32


def _pool(url: str, name: str) -> float:
    return metric(url, f"pdkv:kv_pool_{name}_total", REDIS)


def test_pool_host_down(tmp_path, tiny_llama_cache, references):
    """With the redis host cut off, requests are pool misses (P's saves and D's lookups fail
    within the redis tier's timeouts), answered as colocated; back up, P writes the chunks again
    and D, its prefix cache reset, reads them from the pool."""
    require_reason(unavailable_reason())
    hosts = ["node-p", "node-d", "node-pool"]
    with deployment(tmp_path, tiny_llama_cache, POOL, hosts) as run:
        p, d = run.up.url("prefill0"), run.up.url("decode0")
        run.cut("node-pool")
        hits, written = _pool(d, "hits"), _pool(p, "chunks_written")
        timeouts = _pool(d, "lookup_timeouts")
        for _ in range(2):
            t0 = time.monotonic()
            assert complete(run.endpoint, SHORT, timeout=60)[0] == references["short"]
            assert time.monotonic() - t0 < 20  # the redis tier's 1 s timeouts, not a hang
            assert httpx.post(run.endpoint + "/reset_prefix_cache", timeout=30).status_code == 200
        assert _pool(d, "hits") == hits and _pool(p, "chunks_written") == written
        # D's lookups failed fast (the redis tier's own timeout), not at lookup_timeout_s.
        assert _pool(d, "lookup_timeouts") == timeouts
        failed = metric(p, "pdkv:kv_pool_failures_total", REDIS)
        assert failed + _pool(p, "skipped") > 0, "P's saves neither failed nor were skipped"
        assert run.health()[0] == 200  # the engines are up: the pool is not a backend
        for url in (p, d):
            assert wait_metric(url, FREE, NUM_KV_BLOCKS) == NUM_KV_BLOCKS, url
        run.restore("node-pool")

        def saved() -> bool:  # P's next prefill writes the chunks (the tier retried after 1 s)
            assert httpx.post(run.endpoint + "/reset_prefix_cache", timeout=30).status_code == 200
            assert complete(run.endpoint, SHORT)[0] == references["short"]
            time.sleep(0.5)  # saves are asynchronous
            return _pool(p, "chunks_written") - written >= CHUNKS

        wait_until("P writes into the pool again", saved, 30, every=0.5)
        read = _pool(d, "chunks_read")
        assert httpx.post(d + "/reset_prefix_cache", timeout=30).status_code == 200
        assert complete(run.endpoint, SHORT)[0] == references["short"]
        assert _pool(d, "chunks_read") - read == CHUNKS
        for url in (p, d):
            assert wait_metric(url, FREE, NUM_KV_BLOCKS) == NUM_KV_BLOCKS, url
