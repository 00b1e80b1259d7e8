#!/usr/bin/env bash
# Reproduce weights/: the MARS weights of the embedded default (SmolLM2-135M-Instruct).
#   scripts/train_default.sh [WORK_DIR]     (default WORK_DIR: runs/default)
# Steps: self-distil the prompt set with the base model, MARS-train a LoRA adapter plus the
# mask-token row, measure it on the held-out prompts. Every step resumes if rerun.
# On 2 CPU cores: about 30 minutes of distillation, 20 seconds per training step, 10 minutes of
# evaluation (see weights/README.md for the figures of the shipped run).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-runs/default}
TRAIN_PROMPTS=${TRAIN_PROMPTS:-640}   # training prompts to distil (the shipped run: 640)
ITERS=${ITERS:-130}
MARS=${MARS:-.venv/bin/mars}
BASE=default:SmolLM2-135M-Instruct
mkdir -p "$WORK/prompts"
ln -sf "$PWD/data/prompts/train.jsonl" "$PWD/data/prompts/valid.jsonl" "$WORK/prompts/"

"$MARS" distill --model "$BASE" --prompts "$WORK/prompts" --output "$WORK/distilled" \
    --max-tokens 128 --batch-size 64 --limit "$TRAIN_PROMPTS"

resume=()
[ -d "$WORK/b4/checkpoint" ] && resume=(--resume)
[ -f "$WORK/b4/mars.json" ] || "$MARS" finetune --data "$WORK/distilled" --output "$WORK/b4" "${resume[@]}" \
    --block-size 4 --fine-tune-type lora --lora-rank 16 --lora-alpha 32 --learning-rate 1e-3 \
    --batch-size 8 --iters "$ITERS" --warmup 0.05 --steps-per-eval 50 --save-every 10 \
    --max-seq-length 512 --on-long skip --default-threshold "${DEFAULT_THRESHOLD:-0.7}"

"$MARS" eval --model "$WORK/b4" --baseline "$BASE" --data "$WORK/distilled" --split valid \
    --prompts data/prompts/test.jsonl --limit 32 --max-tokens 128 \
    --threshold 1.0,0.9,0.8,0.7,0.6,0.5,0.4 --lossless \
    --output "$WORK/eval.json" --plot "$WORK/eval.png"
