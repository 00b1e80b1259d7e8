"""What one n-gram lookup costs per row and step, a whole scan of the row (`match`) against
the lookup source's index (`NgramLookup`, which the loop uses), on rows of L random tokens
growing by 2 tokens a step. Prints a table and JSON (--json PATH writes it too).

    python benchmarks/ngram_lookup.py
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from mars.core.decode.drafts import ngram


def per_lookup(fn, base: list[int], steps: int, rng: random.Random) -> float:
    """Microseconds a lookup, over `steps` steps of 2 new tokens on a copy of `base`."""
    seq, spent = list(base), 0.0
    for _ in range(steps):
        seq.extend([rng.randrange(2000), rng.randrange(2000)])
        t0 = time.perf_counter()
        fn(seq)
        spent += time.perf_counter() - t0
    return spent / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="300,2000,8000")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="each figure is the best of this many rounds")
    ap.add_argument("--drafts", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        base = [random.Random(length).randrange(2000) for _ in range(length)]
        scan = min(
            per_lookup(lambda s: ngram.match(s, max_drafts=args.drafts), base, args.steps, random.Random(r))
            for r in range(args.rounds)
        )
        indexed = min(
            per_lookup(
                lambda s, source=ngram.NgramLookup(): source.propose(s, args.drafts), base, args.steps, random.Random(r)
            )
            for r in range(args.rounds)
        )
        rows.append({"length": length, "whole_scan_us": round(scan, 2), "indexed_us": round(indexed, 2)})
    print("| L (row's tokens) | whole scan, us a lookup | indexed, us a lookup |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {r['whole_scan_us']} | {r['indexed_us']} |")
    out = {"steps": args.steps, "rounds": args.rounds, "drafts": args.drafts, "rows": rows}
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
