"""Turn the resume checkpoint of a running (or stopped) `mars finetune` into a MARS checkpoint.

    python scripts/export_checkpoint.py RUN_DIR OUT_DIR [--model BASE] [--default-threshold 0.9]

Useful to evaluate a run part-way without stopping it: RUN_DIR is only read.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("output", type=Path)
    ap.add_argument("--model", default=None, help="The base model the run trained (default: the embedded default).")
    ap.add_argument("--default-threshold", type=float, default=0.9)
    args = ap.parse_args(argv)

    import torch

    from mars.backends.paths import resolve_model_path
    from mars.backends.torch.model import ensure_mask_token, load
    from mars.backends.torch.train import Trainer
    from mars.core.training import CHECKPOINT, TrainSettings
    from mars.default_model import model_ref

    src = args.run / CHECKPOINT
    if not (src / "state.pt").is_file():
        print(f"{src}: no checkpoint (state.pt) to export", file=sys.stderr)
        return 1
    if args.output.exists():
        print(f"{args.output}: exists; choose a new output directory", file=sys.stderr)
        return 1
    settings = TrainSettings(**torch.load(src / "state.pt", weights_only=False)["settings"])
    base, _ = resolve_model_path(args.model, weights=False)
    tm = load(base, dtype="float32", device="cpu", announce=lambda m: None)
    mars = ensure_mask_token(tm.model, tm.tokenizer, None, block_size=settings.block_size, exclude=tm.eos_ids, announce=lambda m: None)
    args.output.mkdir(parents=True)
    shutil.copytree(src, args.output / CHECKPOINT)
    trainer = Trainer(tm, mars, settings, args.output)
    trainer.load_checkpoint()
    mars.default_threshold = args.default_threshold
    trainer.save(tm.tokenizer, model_ref(base))
    print(f"exported step {trainer.step} of {args.run} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
