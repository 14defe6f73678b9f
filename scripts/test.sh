#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
python -m pytest -q "$@"
