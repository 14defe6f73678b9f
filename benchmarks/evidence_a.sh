#!/usr/bin/env bash
# Evidence run A: streamed perplexity + fidelity at 4k and 8k on two books, and recall, for the
# baselines and the presets whose settings do not depend on the sparse-attention choice.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=dynamic,exact,max-compression,kivi2,sink-window,quanto-int4,quanto-int2
kvtier eval ppl --caches $C --contexts 4k,8k --text ../shared/data/pg/dracula.txt ../shared/data/pg/huckleberry_finn.txt \
  --threads 2 --out results/ppl-a.json --fidelity-out results/fidelity-a.json
kvtier eval recall --caches $C --contexts 2k,4k,8k --depths 0.1,0.3,0.5,0.7,0.9 --threads 2 --out results/recall-a.json
