#!/usr/bin/env bash
# The batch-1 command of faster_than_ar.sh on code the weights and their draft corpus never
# saw: the first 16 HumanEval problems (asked as `mars eval --humaneval` asks them), 128
# tokens, one torch thread, interleaved rounds. Needs pip install 'mars-mtp[eval]'. Writes
# benchmarks/results/faster_than_ar_humaneval16_<UTC time>.json and prints the table.
#   benchmarks/faster_than_ar_humaneval.sh [extra mars bench options, e.g. --repeats 3]
set -euo pipefail
cd "$(dirname "$0")/.."
mars=${MARS:-.venv/bin/mars}
stamp=$(date -u +%Y%m%dT%H%M%SZ)
"$mars" bench --backend torch --humaneval 16 --batch-sizes 1 --max-tokens 128 \
  --threads 1 --repeats 2 --threshold 0.95 --block-cache 0 --lossless --verify --forward-k 0 \
  --output "benchmarks/results/faster_than_ar_humaneval16_$stamp.json" "$@"
