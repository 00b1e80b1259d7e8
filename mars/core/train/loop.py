"""Backend-neutral training settings and schedule, shared by the torch and MLX trainers."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

from ..config import MarsConfig

CHECKPOINT = "checkpoint"  # the resumable state inside the output directory
TRAINING_LOG = "training_log.jsonl"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

GATE_NEEDS_LORA = "gates LoRA deltas; it needs fine_tune_type lora"


@dataclass
class TrainSettings:
    fine_tune_type: str = "lora"  # lora | full
    block_size: int = MarsConfig.block_size
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
    val_batches: int = 25  # batches per validation pass (mlx-lm's default); -1: the whole validation set
    seed: int = 0
    normalize: str = "row"
    max_grad_norm: float = 1.0
    init_adapter: str = ""  # LoRA: start from this MARS adapter (its rank, scale, targets and mask row)
    gate: str = "none"  # LoRA: none, or masks (the deltas act at mask positions only; core.config.GATES)
    # The noisy stream's target: "ce", the label; "distill", the model's own clean-stream
    # distribution at the same position (stop-gradient teacher) at `distill_temperature`,
    # mixed with the label's cross-entropy as (1 - distill_mix) CE + distill_mix KL.
    objective: str = "ce"
    distill_temperature: float = 1.0
    distill_mix: float = 1.0
    # The noisy loss's weight per mask slot 1..B (core.loss.align): () weighs every slot alike.
    slot_weights: tuple[float, ...] = ()
    # Weight of a consistency term at the mask positions: the noisy stream's last hidden state
    # (what the LM head reads) pulled to the clean stream's at the same position (stop-gradient),
    # as a squared error relative to the clean state's own squared norm. 0: no such term.
    consistency: float = 0.0

    def __post_init__(self):
        if self.gate != "none" and self.fine_tune_type != "lora":
            raise ValueError(f"gate {self.gate} {GATE_NEEDS_LORA}")


def process_rank() -> int:
    """This process's rank under `torchrun` / `accelerate launch` (RANK) or `mlx.launch`
    (MLX_RANK); 0 alone. Only rank 0 writes outputs and speaks."""
    return int(os.environ.get("RANK") or os.environ.get("MLX_RANK") or 0)


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


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training at `step` of `total`; `saved` is the step of the checkpoint kept in
    the output directory (what --resume continues from), None when there is none yet."""

    def __init__(self, step: int, total: int, saved: int | None):
        super().__init__(f"interrupted at step {step}/{total}")
        self.step, self.total, self.saved = step, total, saved


class _StopRequest:
    """While active, a first Ctrl-C asks the loop to stop after the step it is in (which then
    saves a checkpoint: stopping mid-step would leave weights and optimizer out of step); a
    second one interrupts at once. Only for one process in its main thread: several processes
    cannot agree on a step to stop at, so there Ctrl-C interrupts at once."""

    def __init__(self, enabled: bool, log):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.enabled = self.enabled and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        self.requested = False
        self.log = log

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.log("stopping after this step to save a checkpoint (Ctrl-C again to stop at once)")

    def __enter__(self):
        if self.enabled:
            signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def write_history(history: list[dict], path: Path) -> None:
    """training_log.jsonl: one record per optimizer step (losses, learning rate, tokens/s, validation)."""
    with open(path, "w") as f:
        f.writelines(
            json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in h.items()}) + "\n" for h in history
        )


class Steps(Protocol):
    """What a backend's trainer gives the shared loop."""

    s: TrainSettings
    step: int
    epoch: int
    batch_in_epoch: int
    history: list[dict]
    output: Path
    pad_id: int

    def accumulate(self, batch, first: bool) -> tuple[float, float]:
        """Forward and backward of one micro-batch, adding 1/grad_accumulation of its
        gradient; returns its (noisy, clean) losses. `first` starts an accumulation."""
        ...

    def apply_update(self) -> float:
        """Clip, step the optimizer at this step's learning rate, clear the gradients;
        returns the learning rate of the next step."""
        ...

    def evaluate(self, examples, *, progress: bool = False) -> dict: ...

    def average(self, values: list[float]) -> list[float]:
        """Each value's mean over the processes training together."""
        ...

    def save_checkpoint(self) -> None: ...

    def load_checkpoint(self) -> bool: ...


def run(
    trainer: Steps,
    train_examples,
    valid_examples=(),
    *,
    total: int,
    rank: int = 0,
    world: int = 1,
    resume: bool = False,
    log=print,
    progress: bool = True,
) -> dict:
    """The training loop both backends share: epochs of length-bucketed batches (process
    `rank` of `world` takes every world-th), accumulation, history, validation, checkpoints.
    Ctrl-C raises TrainingInterrupted; alone, the first one stops after its step with a
    checkpoint."""

    from ..files import restore_swapped_dir

    saved = None
    restore_swapped_dir(trainer.output / CHECKPOINT)
    if resume and trainer.load_checkpoint():
        saved = trainer.step
        log(f"resumed from {trainer.output / CHECKPOINT} at step {trainer.step}/{total}")
    bar = tqdm(total=total, initial=trainer.step, disable=not progress or rank != 0, unit="step")
    t0 = time.perf_counter()
    try:
        with _StopRequest(world == 1, log) as stop:
            _loop(trainer, train_examples, valid_examples, total, rank, world, bar, stop, saved, progress)
    finally:
        bar.close()
    return {"steps": trainer.step, "seconds": time.perf_counter() - t0, "history": trainer.history}


def _loop(
    trainer: Steps,
    train_examples,
    valid_examples,
    total: int,
    rank: int,
    world: int,
    bar,
    stop: _StopRequest,
    saved: int | None,
    progress: bool,
) -> None:
    """Train up to step `total`; `saved` is the step of the checkpoint on disk, if any, which
    a Ctrl-C's TrainingInterrupted names."""
    from .data import batches

    s = trainer.s
    tokens = micro = 0
    noisy_sum = clean_sum = 0.0
    t0 = time.perf_counter()
    try:
        while trainer.step < total:
            epoch = list(batches(train_examples, s.batch_size, pad_id=trainer.pad_id, seed=s.seed + trainer.epoch))
            mine = epoch[rank::world]
            for i in range(trainer.batch_in_epoch, len(mine)):
                noisy, clean = trainer.accumulate(mine[i], first=micro % s.grad_accumulation == 0)
                noisy_sum += noisy / s.grad_accumulation
                clean_sum += clean / s.grad_accumulation
                tokens += int(mine[i][2].sum())
                micro += 1
                trainer.batch_in_epoch = i + 1
                if micro % s.grad_accumulation:
                    continue
                next_lr = trainer.apply_update()
                trainer.step += 1
                if world > 1:  # the losses of the whole global batch, as one process would log them
                    noisy_sum, clean_sum = trainer.average([noisy_sum, clean_sum])
                rate = tokens / max(1e-9, time.perf_counter() - t0)
                record = {"step": trainer.step, "noisy": noisy_sum, "clean": clean_sum, "lr": next_lr, "tok_s": rate}
                noisy_sum = clean_sum = 0.0
                bar.set_postfix(noisy=f"{record['noisy']:.3f}", clean=f"{record['clean']:.3f}", tok_s=f"{rate:.0f}")
                bar.update(1)
                if valid_examples and (trainer.step % s.steps_per_eval == 0 or trainer.step == total):
                    record.update(trainer.evaluate(valid_examples, progress=progress and rank == 0))
                    if rank == 0:  # tqdm.write prints even for a disabled bar
                        bar.write(
                            f"step {trainer.step}: val noisy {record['val_noisy']:.4f}, val clean "
                            f"{record['val_clean']:.4f}"
                        )
                trainer.history.append(record)
                if trainer.step < total and (trainer.step % s.steps_per_save == 0 or stop.requested):
                    trainer.save_checkpoint()
                    saved = trainer.step
                if stop.requested and trainer.step < total:
                    raise KeyboardInterrupt
                if trainer.step >= total:
                    break
            else:
                trainer.epoch += 1
                trainer.batch_in_epoch = 0
    except KeyboardInterrupt:
        raise TrainingInterrupted(trainer.step, total, saved) from None


def validation_losses(
    examples, s: TrainSettings, pad_id: int, losses, ar_weight: float, *, progress: bool = False
) -> dict:
    """Row-weighted mean of `losses(batch) -> (noisy, clean)` floats over `s.val_batches`
    batches of the examples (all of them for -1): the same batches at every pass, drawn in a
    fixed shuffled order, since the length-sorted order would take only the shortest."""
    from itertools import islice

    from .data import batches

    count = math.ceil(len(examples) / s.batch_size)
    if s.val_batches >= 0:
        count = min(count, s.val_batches)
    chosen = islice(batches(examples, s.batch_size, pad_id=pad_id, seed=s.seed), count)
    noisy = clean = 0.0
    n = 0
    for batch in tqdm(chosen, total=count, desc="validation", unit="batch", leave=False, disable=not progress):
        a, b = losses(batch)
        rows = len(batch[0])
        noisy += a * rows
        clean += b * rows
        n += rows
    return {"val_noisy": noisy / n, "val_clean": clean / n, "val_loss": (noisy + ar_weight * clean) / n}
