#!/usr/bin/env bash
# AR against every decoding mode, side by side, on the first 16 held-out test prompts
# (data/prompts/test.jsonl), 128 tokens, one torch thread, interleaved rounds. Writes
# benchmarks/results/faster_than_ar_batch{1,8}_<UTC time>.json and prints the tables.
#   benchmarks/faster_than_ar.sh [extra mars bench options, e.g. --repeats 3]
set -euo pipefail
cd "$(dirname "$0")/.."
mars=${MARS:-.venv/bin/mars}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
head -n 16 data/prompts/test.jsonl > "$tmp/test16.jsonl"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
# Batch 1: our AR, transformers generate and prompt lookup, threshold 0.95 (plain and verified), lossless (default, fixed feeds).
"$mars" bench --backend torch --prompts "$tmp/test16.jsonl" --batch-sizes 1 --max-tokens 128 \
  --threads 1 --repeats 2 --threshold 0.95 --block-cache 0 --lossless --verify --forward-k 1,2,3,4,6,8,12,16,24,32 \
  --forward-repeats 3 --output "benchmarks/results/faster_than_ar_batch1_$stamp.json" "$@"
# Batch 8 with the block cache.
"$mars" bench --backend torch --prompts "$tmp/test16.jsonl" --batch-sizes 8 --max-tokens 128 \
  --threads 1 --repeats 2 --threshold 0.95 --block-cache 16 --lossless --verify --no-window --prompt-lookup 0 --forward-k 0 \
  --output "benchmarks/results/faster_than_ar_batch8_$stamp.json" "$@"
