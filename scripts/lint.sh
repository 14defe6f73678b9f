#!/usr/bin/env bash
# Lint: ruff check and ruff format --check over the sources, tests and benchmarks (installs ruff into .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check "ruff>=0.6"
ruff check src tests benchmarks
ruff format --check src tests benchmarks
