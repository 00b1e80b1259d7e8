"""What asking for log-probabilities costs, side by side in one run: the same plans decoded with and
without `logprobs` (the n most likely ids per token), interleaved, on the embedded default with the
shipped weights (or --model), torch on the CPU, batch 1.

    python benchmarks/logprobs_cost.py [--limit 8] [--max-tokens 64] [--repeats 3] [--top 5]
        [--threads 1] [--feed auto|fixed] [--model DIR] [--prompts FILE] [--json OUT]

Plans: AR (threshold 1.0) and the checkpoint's default mode with the draft sources `mars generate`
feeds (lossless greedy for the shipped weights). Each (plan, logprobs) pair decodes one prompt as a
warm-up, then --repeats rounds run every pair in turn, every other round in reverse. Reported per
plan: tokens/s without and with logprobs (medians over the rounds), their ratio per round (median,
min-max), and whether the tokens were the same (they must be). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from mars.prompts import read_prompts
from mars.session import Session

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the embedded default)")
    ap.add_argument("--prompts", default=str(ROOT / "data" / "prompts" / "test.jsonl"))
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=5, help="the most likely ids each token lists")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--feed", choices=("auto", "fixed"), default="auto", help="the default mode's feed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    session = Session(args.model, backend="torch", device="cpu", announce=lambda m: None)
    ids = session.encode(read_prompts(Path(args.prompts))[: args.limit])
    plans = {"ar": dict(threshold=1.0), "default": dict(feed=args.feed)}
    runs = {}
    for name, asked in plans.items():
        for top in (None, args.top):
            plan = session.plan(max_tokens=args.max_tokens, logprobs=top, **asked)
            session.prepare_feed(plan)
            session.decode(ids[:1], plan, 1)  # warm-up
            runs[(name, top)] = plan
    order = list(runs)
    times = {key: [] for key in order}
    tokens = {}
    for r in range(args.repeats):
        for key in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            out = session.decode(ids, runs[key], 1)
            times[key].append((sum(len(t) for t in out.tokens), time.perf_counter() - t0))
            tokens.setdefault(key, out.tokens)

    rows = []
    for name in plans:
        off, on = (name, None), (name, args.top)
        speed = {k: [n / s for n, s in times[k]] for k in (off, on)}
        ratios = [b / a for a, b in zip(speed[off], speed[on])]
        rows.append(
            {
                "plan": name,
                "mode": runs[off].name,
                "tok_s_without": round(statistics.median(speed[off]), 2),
                "tok_s_with": round(statistics.median(speed[on]), 2),
                "ratio_median": round(statistics.median(ratios), 3),
                "ratio_min": round(min(ratios), 3),
                "ratio_max": round(max(ratios), 3),
                "same_tokens": tokens[off] == tokens[on],
            }
        )
    report = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)",
        "prompts": args.prompts,
        "limit": args.limit,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "top": args.top,
        "rows": rows,
    }
    print(json.dumps(report, indent=1))
    print()
    print(f"| plan | mode | tok/s | tok/s, logprobs top {args.top} | with/without (min-max) | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['plan']} | {r['mode']} | {r['tok_s_without']} | {r['tok_s_with']} | "
            f"{r['ratio_median']} ({r['ratio_min']}-{r['ratio_max']}) | {r['same_tokens']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
