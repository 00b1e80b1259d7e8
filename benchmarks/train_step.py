"""Cost of one MARS training step with and without the unread noisy blocks (masks.noisy_start).

    python benchmarks/train_step.py [--model M] --data FILE.jsonl [--batch-size 8] [--batches 6] [--json OUT]

Times forward + backward of the MARS loss (every weight trainable) on the same batches with the
full noisy stream and with the noisy stream starting at the batch's first read block, alternating
which goes first, and checks the two give the same losses. Torch backend. Prints a table; --json
writes the figures. Ratios come from one run, side by side: the machine's load moves both.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def step_time(module, inputs) -> tuple[float, float, float]:
    import torch

    module.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    noisy, clean = module(**inputs)
    (noisy + clean).backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, noisy.item(), clean.item()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="a model or MARS checkpoint (default: the embedded default with its weights)"
    )
    ap.add_argument(
        "--data", required=True, help="a chat/prompt-completion .jsonl file (e.g. data/distilled/train.jsonl)"
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--max-seq-length", type=int, default=512)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)

    import numpy as np

    from mars.backends.torch.loss import MarsLoss, loss_inputs
    from mars.core.train.data import batches
    from mars.evaluate import load_examples, load_model

    session = load_model(args.model, "torch")
    B, mask_id = session.block_size(), session.mask_id()
    tm = session.loaded
    examples = load_examples(
        Path(args.data), tm.tokenizer, block_size=B, max_seq_length=args.max_seq_length, on_long="skip"
    )
    module = MarsLoss(tm.model)
    for p in module.parameters():
        p.requires_grad_(True)
    module.train()
    rows = []
    for i, (ids, labels, lengths) in enumerate(
        batches(examples, args.batch_size, pad_id=tm.tokenizer.eos_token_id, seed=0)
    ):
        if i == args.batches + 1:
            break
        inputs = {
            trim: loss_inputs(ids, labels, lengths, B, mask_id, tm.dtype, tm.device, trim=trim)
            for trim in (False, True)
        }
        got = {}
        for trim in (False, True) if i % 2 else (True, False):
            got[trim] = step_time(module, inputs[trim])
        if i == 0:
            continue  # warm-up
        (t_full, n_full, c_full), (t_trim, n_trim, c_trim) = got[False], got[True]
        if not (np.isclose(n_full, n_trim, rtol=1e-4) and np.isclose(c_full, c_trim, rtol=1e-4)):
            raise SystemExit(f"batch {i}: losses differ: full ({n_full}, {c_full}) vs trimmed ({n_trim}, {c_trim})")
        rows.append(
            {
                "batch": i,
                "length": int(ids.shape[1]),
                "fed_full": int(inputs[False]["input_ids"].numel()),
                "fed_trimmed": int(inputs[True]["input_ids"].numel()),
                "seconds_full": t_full,
                "seconds_trimmed": t_trim,
            }
        )
    total = lambda k: sum(r[k] for r in rows)  # noqa: E731
    rep = {
        "model": args.model or "default",
        "data": args.data,
        "batch_size": args.batch_size,
        "block_size": B,
        "batches": rows,
        "fed_ratio": total("fed_trimmed") / total("fed_full"),
        "speedup": total("seconds_full") / total("seconds_trimmed"),
    }
    print(f"{'batch':>5} {'L':>4} {'fed full':>9} {'trimmed':>8} {'s full':>7} {'s trim':>7}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['length']:>4} {r['fed_full']:>9} {r['fed_trimmed']:>8} "
            f"{r['seconds_full']:>7.2f} {r['seconds_trimmed']:>7.2f}"
        )
    print(
        f"tokens fed: {rep['fed_ratio']:.3f} of the full layout; "
        f"step time: {rep['speedup']:.2f}x faster trimmed (same losses)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2) + "\n")
    return rep


if __name__ == "__main__":
    main()
