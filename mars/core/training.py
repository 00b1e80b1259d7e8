"""Backend-neutral training settings and schedule, shared by the torch and MLX trainers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

CHECKPOINT = "checkpoint"  # the resumable state inside the output directory
TRAINING_LOG = "training_log.jsonl"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class TrainSettings:
    fine_tune_type: str = "lora"  # lora | full
    block_size: int = 4
    ar_weight: float = 1.0
    iters: int = 0  # optimizer steps; 0: derived from epochs
    epochs: float = 1.0
    batch_size: int = 4
    grad_accumulation: int = 1
    learning_rate: float = 1e-4
    warmup: float = 0.03  # fraction of the steps
    weight_decay: float = 0.0
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    steps_per_eval: int = 100
    steps_per_save: int = 100
    seed: int = 0
    normalize: str = "row"
    max_grad_norm: float = 1.0


def lr_lambda(total: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def total_steps(n_examples: int, s: TrainSettings, shards: int = 1) -> tuple[int, int]:
    """(optimizer steps, warmup steps): --iters, or --epochs over the batches each process sees."""
    per_epoch = math.ceil(n_examples / s.batch_size)
    steps_per_epoch = max(1, per_epoch // (s.grad_accumulation * shards))
    total = s.iters or max(1, math.ceil(s.epochs * steps_per_epoch))
    warmup = max(1, int(round(s.warmup * total))) if s.warmup > 0 else 0
    return total, warmup


def write_history(history: list[dict], path: Path) -> None:
    """training_log.jsonl: one record per optimizer step (losses, learning rate, tokens/s, validation)."""
    with open(path, "w") as f:
        f.writelines(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in h.items()}) + "\n" for h in history)
