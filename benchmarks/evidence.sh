#!/usr/bin/env bash
# Evidence runs behind BENCHMARKS.md (SmolLM2-135M, CPU, 1 thread per process; two processes
# may run side by side on the two cores - perplexity and recall are not timing measurements,
# bench and offload are: run those alone).
#   ppl4k  : streamed perplexity + fidelity at 4k on two books, every preset and baseline
#   ppl8k  : the same at 8k
#   recall : a 5-digit number planted at depths 10/25/50/75/90% at 2k/4k, SAMPLES (default 2) cases per cell
#   recall8k: the same at 7,600 tokens (the model's context is 8,192), depths 10/50/90%, SAMPLES (default 1)
#   sparse : attention work skipped vs perplexity at 8k (benchmarks/sparse_work.py)
#   bench  : decode tokens/s, prefill time, KV bytes, peak RSS at 4k and 8k (1 thread)
#   offload: prefetch on vs off: offload-cpu at 8k, offload-disk at 4k with every read from the device
#            (benchmarks/offload_bench.py --drop-page-cache)
# CACHES=a,b,... overrides the caches of ppl*/recall*/bench.
# Usage: bash benchmarks/evidence.sh ppl4k|ppl8k|recall|recall8k|sparse|bench|offload   (results in results/)
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p results
BOOKS="../shared/data/pg/dracula.txt ../shared/data/pg/huckleberry_finn.txt"
ALL=dynamic,exact,default,default:dense,chat,code,max-compression,kivi2,sink-window,quanto-int4,quanto-int2,offload-cpu,offload-disk
case "$1" in
  ppl4k|ppl8k) ctx=${1#ppl}
    kvtier eval ppl --caches "${CACHES:-$ALL}" --contexts "$ctx" --text $BOOKS --threads 1 \
      --out "results/ppl-$ctx.json" --fidelity-out "results/fidelity-$ctx.json" ;;
  recall) kvtier eval recall --caches "${CACHES:-$ALL}" --contexts 2k,4k --depths 0.1,0.25,0.5,0.75,0.9 \
      --samples "${SAMPLES:-2}" --threads 1 --out results/recall.json ;;
  recall8k) kvtier eval recall --caches "${CACHES:-$ALL}" --contexts 7600 --depths 0.1,0.5,0.9 \
      --samples "${SAMPLES:-1}" --threads 1 --out results/recall-8k.json ;;
  sparse) python benchmarks/sparse_work.py --length 8192 --threads 1 \
      --variants no-sparse tokens-mass0.98 tokens-mass0.97 tokens-mass0.95 | tee results/sparse-8k.log ;;
  bench) kvtier bench --caches "${CACHES:-$ALL,default:per-tier,default:reference}" --contexts 4k,8k --new-tokens 8 --rounds 3 \
      --threads 1 --out results/bench.json ;;
  offload) python benchmarks/offload_bench.py --tokens 8192 --new-tokens 8 --rounds 2 --threads 1 --presets offload-cpu \
      | tee results/offload-cpu-8k.log
    python benchmarks/offload_bench.py --tokens 4096 --new-tokens 8 --rounds 2 --threads 1 --presets offload-disk \
      --drop-page-cache | tee results/offload-disk-4k-cold.log ;;
  *) echo "usage: $0 ppl4k|ppl8k|recall|recall8k|sparse|bench|offload" >&2; exit 2 ;;
esac
