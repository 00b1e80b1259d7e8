"""Cost of a gated adapter in decoding: one cached forward of k new tokens, of which m are
masks, through the shipped (gated) weights and through the plain base.

    python benchmarks/gated_forward.py [--weights weights] [--threads 1] [--repeats 15] [--json OUT]

A forward that feeds no mask runs the base layers alone (GatedLoRALinear); one that feeds
masks adds the low-rank deltas there. Both models run through the torch decoder (packed
weights, as `mars generate` decodes), interleaved per (k, m) so the machine's load moves
them alike; prints medians in milliseconds and the gated-minus-base difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

CASES = ((1, 0), (5, 0), (5, 4), (9, 4), (9, 8), (13, 8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="weights")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--prefix", type=int, default=46, help="cached tokens before the timed forward")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import numpy as np
    import torch

    from mars.backends.torch.decode import TorchDecoder
    from mars.backends.torch.load import load
    from mars.core.decode.plan import Sampling

    torch.set_num_threads(args.threads)
    quiet = dict(announce=lambda m: None)
    gated = load(args.weights, **quiet)
    base = load("default:SmolLM2-135M-Instruct", **quiet)
    mask = gated.mars.mask_token_id
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 1000, size=(1, args.prefix))
    greedy = Sampling()
    decoders = {"gated": TorchDecoder(gated), "base": TorchDecoder(base)}
    caches = {}
    for name, dec in decoders.items():
        caches[name] = dec.new_cache(1)
        dec.step(
            caches[name],
            prompt,
            np.arange(args.prefix)[None],
            None,
            np.array([[args.prefix - 1]]),
            metric=None,
            sampling=greedy,
        )

    def once(name, k, m):
        new = rng.integers(100, 1000, size=(1, k))
        if m:
            new[0, k - m :] = mask
        t0 = time.perf_counter()
        decoders[name].step(
            caches[name], new, args.prefix + np.arange(k)[None], None, np.arange(k)[None], metric=None, sampling=greedy
        )
        seconds = time.perf_counter() - t0
        decoders[name].crop(caches[name], args.prefix)
        return seconds

    rows = []
    for k, m in CASES:
        samples = {name: [] for name in decoders}
        for rep in range(args.repeats + 1):  # the first round warms up
            for name in decoders:
                s = once(name, k, m)
                if rep:
                    samples[name].append(s)
        g, b = (statistics.median(samples[n]) * 1e3 for n in ("gated", "base"))
        rows.append({"k": k, "masks": m, "gated_ms": g, "base_ms": b, "extra_ms": g - b})
        print(f"k={k:2d} masks={m}: gated {g:6.1f} ms  base {b:6.1f} ms  extra {g - b:+5.1f} ms", flush=True)
    report = {
        "weights": args.weights,
        "threads": args.threads,
        "repeats": args.repeats,
        "prefix": args.prefix,
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
