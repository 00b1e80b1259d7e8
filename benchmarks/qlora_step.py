"""What one MARS LoRA training step costs on a quantized MLX base, against the float base and
against mlx-lm's own LoRA step on the same quantized model and tokens.

    python benchmarks/qlora_step.py [--bits 4] [--batch-size 2] [--length 256] [--rounds 3] [--json OUT]

The embedded default (or --model, a float model directory) is quantized with `mars convert -q`
into a temporary directory. Each round times, in turn: a MARS step (forward and backward of both
streams, AdamW update; the trainer `mars finetune --backend mlx` runs) on the quantized base, the
same on the float base, and mlx-lm's step (its `default_loss` and update, compiled as `mlx_lm.lora`
runs it) on the quantized base, with the same LoRA layers (rank 8, the last 16 layers, the usual
projections) and the same rows: `--batch-size` rows of `--length` tokens from the distilled
training replies, the last three quarters of each row labelled. mlx-lm's first step, which
compiles it, is not timed (`--warmup`: one untimed step of each). Ratios are medians of the rounds, side by side in one
run. MARS feeds two streams of `--length` tokens (the noisy one trimmed to the first labelled block), so about twice
mlx-lm's step is what the method costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rows_of(tokenizer, batch: int, length: int):
    import numpy as np

    text = " ".join(
        json.loads(line)["messages"][-1]["content"] for line in (ROOT / "data/distilled/train.jsonl").open()
    )
    ids = tokenizer.encode(text)[: batch * length]
    ids = np.array(ids, dtype=np.int64).reshape(batch, length)
    labels = np.full(ids.shape, -100)
    labels[:, length // 4 :] = ids[:, length // 4 :]
    return ids, labels, np.full(batch, length)


def mars_step(path: Path, batch, out: Path):
    """A function running one MARS LoRA step of `mars finetune --backend mlx` on `batch`."""
    from mars.backends.mlx.load import ensure_mask_token, load
    from mars.backends.mlx.train import MlxTrainer
    from mars.core.train.loop import TrainSettings

    loaded = load(path, announce=lambda m: None)
    mars = ensure_mask_token(loaded.model, loaded.tokenizer, None, block_size=4, announce=lambda m: None)
    trainer = MlxTrainer(
        loaded, mars, TrainSettings(block_size=4, lora_rank=8, lora_alpha=16), out, announce=lambda m: None
    )
    trainer._world, trainer._schedule = 1, (lambda step: 1.0)

    def step():
        trainer.accumulate(batch, first=True)
        trainer.apply_update()

    return step


def mlx_lm_step(path: Path, batch):
    """One step of mlx-lm's own LoRA training (its loss, its compiled update) on `batch`'s rows."""
    from functools import partial

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm import load
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(path))
    model.freeze()
    keys = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    linear_to_lora_layers(model, 16, {"rank": 8, "scale": 2.0, "dropout": 0.0, "keys": keys})
    model.train()
    opt = optim.AdamW(learning_rate=1e-5, bias_correction=True)
    value_and_grad = nn.value_and_grad(model, default_loss)
    ids, labels, lengths = batch
    tokens = mx.array(ids)
    start = int((labels[0] != -100).argmax())
    spans = mx.array([[start, int(n) - 1] for n in lengths])
    state = [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def update(tokens, spans):
        (loss, _), grad = value_and_grad(model, tokens, spans)
        opt.update(model, grad)
        return loss

    def step():
        mx.eval(update(tokens, spans), state)

    return step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a float model directory (default: the embedded default)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--warmup", action="store_true", help="one untimed step of each before the rounds (mlx-lm's always)"
    )
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)

    import mlx.core as mx

    from mars.checkpoint.default_model import default_model_dir
    from mars.checkpoint.paths import load_tokenizer
    from mars.convert import convert_model

    float_dir = Path(args.model) if args.model else default_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        quantized = convert_model(
            float_dir, Path(tmp) / "q", "mlx", q_bits=args.bits, q_group_size=args.group_size, announce=lambda m: None
        )
        batch = rows_of(load_tokenizer(float_dir), args.batch_size, args.length)
        steps = {
            f"mars {args.bits}-bit": mars_step(quantized, batch, Path(tmp) / "a"),
            "mars float": mars_step(float_dir, batch, Path(tmp) / "b"),
            f"mlx-lm {args.bits}-bit": mlx_lm_step(quantized, batch),
        }
        times = {name: [] for name in steps}
        steps[f"mlx-lm {args.bits}-bit"]()  # its first call compiles the step: a warm-up, not timed
        if args.warmup:
            for name, step in steps.items():
                step()
        for r in range(args.rounds):
            for name, step in steps.items():
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
                print(f"round {r + 1}: {name} {times[name][-1]:.2f} s", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    unit = median[f"mlx-lm {args.bits}-bit"]
    report = {
        "model": str(float_dir),
        "bits": args.bits,
        "group_size": args.group_size,
        "batch_size": args.batch_size,
        "length": args.length,
        "rounds": args.rounds,
        "device": str(mx.default_device()),
        "seconds": times,
        "median_seconds": median,
        "x_mlx_lm_step": {n: m / unit for n, m in median.items()},
        "quantized_over_float": median[f"mars {args.bits}-bit"] / median["mars float"],
    }
    print(f"\n| step (batch {args.batch_size} x {args.length} tokens) | median s | x mlx-lm's {args.bits}-bit step |")
    print("|---|---|---|")
    for name, m in median.items():
        print(f"| {name} | {m:.2f} | {m / unit:.2f} |")
    print(f"\nMARS on the {args.bits}-bit base / on the float base: {report['quantized_over_float']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
