#!/usr/bin/env bash
# Evidence runs behind BENCHMARKS.md (SmolLM2-135M, CPU, 1 thread per process; two processes
# may run side by side on the two cores - perplexity and recall are not timing measurements).
#   ppl4k : streamed perplexity + fidelity at 4k on two books, every preset and baseline
#   ppl8k : the same at 8k for CACHES (default: the baselines and max-compression)
#   recall: a 5-digit number planted at depths 10/50/90% at 2k/4k (CACHES, default every preset and baseline)
#   bench : decode tokens/s, prefill time, KV bytes, peak RSS at 4k and 8k (1 thread)
# Usage: bash benchmarks/evidence.sh ppl4k|ppl8k|recall|bench   (results in results/)
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
BOOKS="../shared/data/pg/dracula.txt ../shared/data/pg/huckleberry_finn.txt"
ALL=dynamic,default,chat,code,max-compression,kivi2,sink-window,quanto-int4,quanto-int2,offload-cpu,offload-disk
case "$1" in
  ppl4k) kvtier eval ppl --caches "${CACHES:-$ALL}" --contexts 4k --text $BOOKS --threads 1 \
           --out results/ppl-4k.json --fidelity-out results/fidelity-4k.json ;;
  ppl8k) kvtier eval ppl --caches "${CACHES:-dynamic,max-compression,kivi2,sink-window,quanto-int4}" --contexts 8k \
           --text $BOOKS --threads 1 --out results/ppl-8k.json --fidelity-out results/fidelity-8k.json ;;
  recall) kvtier eval recall --caches "${CACHES:-$ALL,default:dense}" --contexts "${CONTEXTS:-2k,4k}" --depths 0.1,0.5,0.9 \
           --threads 1 --out "results/recall${TAG:-}.json" ;;
  bench) kvtier bench --caches "${CACHES:-$ALL,default:dense,default:reference}" --contexts 4k,8k --new-tokens 8 --rounds 3 --threads 1 \
           --out results/bench.json ;;
  *) echo "usage: $0 ppl4k|ppl8k|recall|bench" >&2; exit 2 ;;
esac
