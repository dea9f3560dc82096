"""A stand-in for `python -m pdkv.cli` in the recipe tests (tests/report/test_recipes.py): the
same argv, no engine. Its PID goes to $FAKE_PDKV_PIDS (one line per start).

* `up ... --mode MODE ...`: prints `pdkv up`'s "ready: http://fake-MODE  (...)" line, then
  sleeps until it is stopped;
* `serve ... --port P`: answers 200 to every GET on 127.0.0.1:P until it is stopped;
* `bench serve --base-url http://fake-MODE [--endpoint EP --max-concurrency C] --result-json
  PATH`: copies $FAKE_PDKV_RESULTS/MODE-EP-cC.json, else MODE.json (MODE "serve" against a
  `serve`), to PATH.
"""

import http.server
import os
import shutil
import sys
import time


def flag(argv: list[str], name: str, default: str = "") -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def main(argv: list[str]) -> int:
    with open(os.environ["FAKE_PDKV_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
    if argv[0] == "up":
        print("starting 1 processes", flush=True)
        print(f"ready: http://fake-{flag(argv, '--mode')}  (OpenAI API at ...)", flush=True)
        while True:
            time.sleep(1)
    if argv[0] == "serve":
        class Ok(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(200)
                self.end_headers()

        http.server.HTTPServer(("127.0.0.1", int(flag(argv, "--port"))), Ok).serve_forever()
    if argv[:2] == ["bench", "serve"]:
        url = flag(argv, "--base-url")
        name = url.split("fake-")[1] if "fake-" in url else "serve"
        folder = os.environ["FAKE_PDKV_RESULTS"]
        run = f"{name}-{flag(argv, '--endpoint')}-c{flag(argv, '--max-concurrency')}.json"
        found = [p for p in (run, name + ".json") if os.path.exists(os.path.join(folder, p))]
        shutil.copy(os.path.join(folder, found[0]), flag(argv, "--result-json"))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
