#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: `kvtier demo` on SmolLM2-135M, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
kvtier demo "$@"
