"""Cost of one LoRA training step: ungated, gated in one joint forward, gated with the clean
stream in a pass of its own without gradients (what `mars finetune --gate masks` runs).

    python benchmarks/gated_step.py [--model M] [--data data/distilled/train.jsonl] [--batch-size 4] [--batches 4]
        [--json OUT]

Times forward + backward of the MARS loss on the same batches, the three variants interleaved
(A B C A B C ...) so the machine's load moves them alike; prints medians and ratios to the
ungated step. Torch backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default:SmolLM2-135M-Instruct")
    ap.add_argument("--data", type=Path, default=Path("data/distilled/train.jsonl"))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model

    from mars.backends.torch.gate import MaskGate
    from mars.backends.torch.load import ensure_mask_token, load
    from mars.backends.torch.loss import MarsLoss, loss_inputs
    from mars.core.train.data import batches, load_split
    from mars.core.train.loop import LORA_TARGETS

    torch.set_num_threads(args.threads)
    tm = load(args.model, announce=lambda m: None)
    base = tm.model
    mars = ensure_mask_token(base, tm.tokenizer, None, block_size=4, exclude=tm.eos_ids, announce=lambda m: None)
    split = load_split(args.data, "train", tokenizer=tm.tokenizer, block_size=4, max_seq_length=512, on_long="skip")
    pad = tm.tokenizer.eos_token_id
    chosen = list(batches(split.examples[: args.batch_size * args.batches], args.batch_size, pad_id=pad, shuffle=False))
    present = {n.rsplit(".", 1)[-1] for n, _ in base.named_modules()}
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=[t for t in LORA_TARGETS if t in present])
    )
    row = torch.nn.Parameter(model.get_input_embeddings().weight[mars.mask_token_id].detach().clone().float())
    gate = MaskGate(model, mars.mask_token_id)
    ungated = MarsLoss(model, row, mars.mask_token_id)
    joint = MarsLoss(model, row, mars.mask_token_id, gate=gate)
    joint.split = False
    gated = MarsLoss(model, row, mars.mask_token_id, gate=gate)
    variants = {"ungated": ungated, "gated, joint forward": joint, "gated, clean pass without gradients": gated}
    inputs = [
        loss_inputs(ids, labels, lengths, 4, mars.mask_token_id, torch.float32, "cpu")
        for ids, labels, lengths in chosen
    ]

    def step(module, inp):
        model.zero_grad(set_to_none=True)
        row.grad = None
        if module is ungated:
            gate.remove()  # no hooks at all: the plain LoRA step
        t0 = time.perf_counter()
        noisy, clean = module(**inp)
        (noisy + clean).backward()
        seconds = time.perf_counter() - t0
        return seconds, noisy.item()

    times = {k: [] for k in variants}
    for rnd in range(args.rounds + 1):
        for name, module in variants.items():
            if name != "ungated" and not gate.handles:
                gate.__init__(model, mars.mask_token_id)  # hooks back on
            total = sum(step(module, inp)[0] for inp in inputs)
            if rnd:
                times[name].append(total / len(inputs))
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "model": str(tm.path),
        "batch_size": args.batch_size,
        "batches": args.batches,
        "threads": args.threads,
        "tokens_per_batch": [int(np.asarray(i["input_ids"].shape).prod()) for i in inputs],
        "seconds_per_step": med,
        "runs": times,
        "ratio_to_ungated": {k: v / med["ungated"] for k, v in med.items()},
    }
    for k, v in med.items():
        print(f"{k:<40} {v:8.3f} s/step  {v / med['ungated']:.2f}x the ungated step")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
