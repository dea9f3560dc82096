#!/usr/bin/env bash
# The system (Debian/Ubuntu) packages pdkv's build and test suite need, installed when missing.
# Called by `make setup` and by .ci/run; safe to run again (it only checks when all are present).
#   g++, python3-dev  the C++ CPU ops (pdkv/model/paged_decode_build.py) and their ISA check
#   ccache            caches those compiles (torch's cpp_extension uses it when present)
#   redis-server      the KV pool's redis tier (tests start their own on a free loopback port)
#   libibverbs1       the optional Mooncake transfer engine / store (pip extra "mooncake")
#   iproute2          ip / tc: `pdkv bench handoff --link-rate` and the network-namespace tests
#   prometheus        the Grafana dashboard's PromQL checked against a real Prometheus (tests)
# As root: apt-get installs what is missing. Otherwise: prints the one command to run and exits 0,
# and the tests that need a missing package skip with that reason (tests/system_packages.py);
# under CI=true a missing package is an error.
set -euo pipefail
PYTHON=${PYTHON:-python3}

ldconfig_p() { { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } || true; }

missing=()
command -v g++ >/dev/null || missing+=(g++)
py_include=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$py_include/Python.h" ] || missing+=(python3-dev)
command -v ccache >/dev/null || missing+=(ccache)
command -v redis-server >/dev/null || missing+=(redis-server)
ldconfig_p | grep -q 'libibverbs\.so\.1 ' || missing+=(libibverbs1)
{ command -v ip && command -v tc; } >/dev/null || missing+=(iproute2)
command -v prometheus >/dev/null || missing+=(prometheus)

if [ ${#missing[@]} -eq 0 ]; then
  echo "system packages: all present (g++ python3-dev ccache redis-server libibverbs1 iproute2 prometheus)"
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "system packages: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  exit 0
fi
echo "system packages missing: ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}" >&2
case "${CI:-}" in
  1|true|TRUE|True) exit 1 ;;
esac
echo "(continuing: the tests that need them will be skipped)" >&2
exit 0
