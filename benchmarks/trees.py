"""Token trees from the masks' ranked guesses (mars.core.decode.drafts.tree) against the chain, on the
embedded default with the shipped weights (or --model), torch on the CPU, batch 1.

    python benchmarks/trees.py [--limit 32] [--max-tokens 128] [--trees 4,8,16,32] [--humaneval 40]
        [--sampled 0.7] [--speed-tree 8] [--speed-only] [--repeats 2] [--threads 1] [--model DIR] [--prompts FILE]
        [--json OUT]

1. Masks only: lossless greedy, no lookup drafts (n-gram, corpus), no runner-up groups, the fixed
   feed (B masks and B spare groups every step), the chain alone and with trees of each size; per
   prompt set (the first --limit held-out test prompts; with --humaneval N, HumanEval problems
   1..N too): tokens per forward and replies identical to AR's (they must all be). With --sampled T,
   the same sampled at temperature T (seed 0): tokens per forward.
2. Speed (--speed, or --speed-tree N > 0): AR, the default mode (the draft sources `mars generate`
   feeds with no options, the cost-aware feed, trees "auto": up to 16 nodes where this device's curve
   says they pay), the default mode without trees (`--tree 0`, the default before trees were) and,
   with --speed-tree N, with trees of up to N nodes, interleaved over --repeats rounds (every other
   round reversed) on the test prompts: tokens/s medians, and each mode's ratio to AR within a round
   (median, min-max).
3. A flat cost curve (--flat; what an overhead-bound device measures, where a wider forward costs
   what a narrower one does): the feed decides on `CostCurve({1: 1.0, 256: 1.0})` given as a
   measurement is (FeedController), and the default mode, with and without trees, reports its
   tokens per forward on the test prompts, every reply compared with AR's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from mars.core.decode.plan import Sampling
from mars.prompts import read_prompts
from mars.session import Session

ROOT = Path(__file__).resolve().parent.parent


def masks_only(session, ids, ar, sizes, max_tokens, sampling=None) -> list[dict]:
    """Masks-only lossless per tree size; with `sampling` (a Sampling) sampled, `ar` then None (sampled
    replies are compared with AR's in distribution by the tests, not here)."""
    rows = []
    for n in sizes:
        plan = session.plan(
            lossless=True,
            max_tokens=max_tokens,
            ngram=0,
            alternatives=0,
            corpus=None,
            feed="fixed",
            tree=n,
            **({"sampling": sampling} if sampling is not None else {}),
        )
        t0 = time.perf_counter()
        out = session.decode(ids, plan, 1)
        total = out.total
        rows.append(
            {
                "tree": n,
                "tokens_per_forward": round(total.tokens_per_forward, 3),
                "identical_to_ar": sum(a == b for a, b in zip(out.tokens, ar)) if ar is not None else None,
                "prompts": len(ids),
                "tokens_by_source": total.by_source(),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def speed(session, ids, tree: int, max_tokens: int, repeats: int) -> dict:
    plans = {
        "ar": session.plan(threshold=1.0, max_tokens=max_tokens),
        "default": session.plan(max_tokens=max_tokens),
        "default, tree 0": session.plan(max_tokens=max_tokens, tree=0),
    }
    if tree > 0:
        plans[f"default, tree {tree}"] = session.plan(max_tokens=max_tokens, tree=tree)
    for plan in plans.values():
        session.prepare_feed(plan)
        session.decode(ids[:1], plan, 1)  # warm-up
    times = {k: [] for k in plans}
    tokens = {}
    order = list(plans)
    for r in range(repeats):
        for k in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            out = session.decode(ids, plans[k], 1)
            times[k].append(sum(len(t) for t in out.tokens) / (time.perf_counter() - t0))
            tokens.setdefault(k, out.tokens)
    rows = []
    for k in order:
        ratios = [s / a for s, a in zip(times[k], times["ar"])]
        rows.append(
            {
                "mode": k,
                "name": plans[k].name,
                "tok_s": round(statistics.median(times[k]), 2),
                "vs_ar": round(statistics.median(ratios), 3),
                "vs_ar_min": round(min(ratios), 3),
                "vs_ar_max": round(max(ratios), 3),
                "identical_to_ar": sum(a == b for a, b in zip(tokens[k], tokens["ar"])),
            }
        )
    return {"rows": rows, "repeats": repeats}


def flat(session, ids, ar, max_tokens: int) -> list[dict]:
    """The default mode (trees auto) and without trees on a flat cost curve: tokens per forward."""
    from mars.core.decode.cost import CostCurve
    from mars.core.decode.feed import FeedController

    kept = session.controller
    rows = []
    try:
        for label, ask in (("default (trees auto)", {}), ("default, tree 0", {"tree": 0})):
            session.controller = FeedController(CostCurve({1: 1.0, 256: 1.0}, refresh=0.0))
            plan = session.plan(max_tokens=max_tokens, **ask)
            t0 = time.perf_counter()
            out = session.decode(ids, plan, 1)
            total = out.total
            rows.append(
                {
                    "mode": label,
                    "name": plan.name,
                    "tokens_per_forward": round(total.tokens_per_forward, 3),
                    "fed_tokens_per_forward": round(total.fed_tokens / max(total.forwards, 1), 2),
                    "identical_to_ar": sum(a == b for a, b in zip(out.tokens, ar)),
                    "prompts": len(ids),
                    "tokens_by_source": total.by_source(),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        session.controller = kept
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default=str(ROOT / "data" / "prompts" / "test.jsonl"))
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--trees", default="4,8,16,32")
    ap.add_argument("--humaneval", type=int, default=0)
    ap.add_argument("--sampled", type=float, default=0.0, help="also masks-only lossless sampled at this temperature")
    ap.add_argument("--speed", action="store_true", help="time AR and the default mode with and without trees")
    ap.add_argument("--speed-tree", type=int, default=0)
    ap.add_argument("--flat", action="store_true", help="the default mode's tokens per forward on a flat cost curve")
    ap.add_argument("--speed-only", action="store_true", help="skip the masks-only sizes")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    session = Session(args.model, backend="torch", device="cpu", announce=lambda m: None)
    sizes = [0] + [int(x) for x in args.trees.split(",") if x]
    sets = {"test": session.encode(read_prompts(Path(args.prompts))[: args.limit])}
    if args.humaneval:
        from mars import humaneval

        sets[f"humaneval 1-{args.humaneval}"] = session.encode(
            [humaneval.messages(p) for p in humaneval.load_problems(args.humaneval)]
        )
    report = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)",
        "max_tokens": args.max_tokens,
        "masks_only": {},
    }
    for name, ids in sets.items() if not args.speed_only else ():
        ar = session.decode(ids, session.plan(threshold=1.0, max_tokens=args.max_tokens), 1).tokens
        report["masks_only"][name] = masks_only(session, ids, ar, sizes, args.max_tokens)
        if args.sampled:
            sampling = Sampling(temperature=args.sampled, seed=0)
            rows = masks_only(session, ids, None, sizes, args.max_tokens, sampling)
            report["masks_only"][f"{name}, sampled (temperature {args.sampled:g})"] = rows
    if args.flat:
        ids = sets["test"]
        ar = session.decode(ids, session.plan(threshold=1.0, max_tokens=args.max_tokens), 1).tokens
        report["flat_curve"] = flat(session, ids, ar, args.max_tokens)
    if args.speed or args.speed_tree:
        report["speed"] = speed(session, sets["test"], args.speed_tree, args.max_tokens, args.repeats)
    print(json.dumps(report, indent=1))
    if report["masks_only"]:
        print()
        print("| prompts | " + " | ".join("chain" if n == 0 else f"tree {n}" for n in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
    for name, rows in report["masks_only"].items():
        cells = [
            f"{r['tokens_per_forward']}"
            + (f" ({r['identical_to_ar']}/{r['prompts']})" if r["identical_to_ar"] is not None else "")
            for r in rows
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if "speed" in report:
        print()
        print("| mode | tok/s | vs AR (min-max) | identical to AR |")
        print("|---|---|---|---|")
        for r in report["speed"]["rows"]:
            print(
                f"| {r['name']}{' (' + r['mode'] + ')' if r['mode'].startswith('default') else ''} | {r['tok_s']} | "
                f"{r['vs_ar']} ({r['vs_ar_min']}-{r['vs_ar_max']}) | {r['identical_to_ar']} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
