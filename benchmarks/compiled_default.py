"""The default model's steps compiled against eager: AR and the default mode, side by side.

    python benchmarks/compiled_default.py                     # 4 test prompts x 64 tokens, 2 rounds
    python benchmarks/compiled_default.py --prompts 8 --rounds 3

Two sessions over the embedded default with the shipped weights (torch, float32, one thread by
default), one with `compile=True` (models.CompiledStep), decode the first N held-out test prompts
one at a time, as `mars generate` plans them: AR (`--threshold 1.0`) and the checkpoint's default
mode. One untimed warm-up of each (compiling there; the graphs and the time it took are reported),
then interleaved rounds (every other one in reversed order). Prints a table; writes JSON to
--output (default benchmarks/results/compiled_default_<UTC time>.json). Every compiled reply must
equal the eager one (`replies_equal`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from mars.core.files import atomic_write_text
    from mars.prompts import read_prompts
    from mars.session import Session

    quiet = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    sessions = {
        "eager": Session(None, backend="torch", device="cpu", announce=quiet),
        "compiled": Session(None, backend="torch", device="cpu", announce=quiet, compile=True),
    }
    ids = sessions["eager"].encode(read_prompts(ROOT / "data" / "prompts" / "test.jsonl")[: args.prompts])
    asks = {"ar": dict(threshold=1.0), "default": {}}
    first, warm = {}, {}
    for mode, ask in asks.items():
        for kind, s in sessions.items():
            plan = s.plan(max_tokens=args.max_tokens, **ask)
            t0 = time.perf_counter()
            first[mode, kind] = (plan.name, s.decode(ids, plan, 1).tokens)
            warm[f"{mode}_{kind}"] = round(time.perf_counter() - t0, 1)
    rates: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for mode, ask in asks.items():
            kinds = list(sessions.items())
            for kind, s in kinds if rnd % 2 == 0 else kinds[::-1]:
                plan = s.plan(max_tokens=args.max_tokens, **ask)
                t0 = time.perf_counter()
                tokens = s.decode(ids, plan, 1).tokens
                seconds = time.perf_counter() - t0
                if tokens != first[mode, kind][1]:
                    raise SystemExit(f"{mode} {kind}: greedy replies changed between rounds")
                rates.setdefault((mode, kind), []).append(sum(map(len, tokens)) / seconds)
    report = {
        "benchmark": "compiled_default",
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": vars(args),
        "warmup_seconds": warm,
        "graphs": sessions["compiled"].decoder.compiled.compiles,
        "modes": {
            mode: {
                "plan": first[mode, "eager"][0],
                "tokens_per_s": {kind: [round(r, 3) for r in rates[mode, kind]] for kind in sessions},
                "compiled_x_eager": [round(c / e, 4) for e, c in zip(rates[mode, "eager"], rates[mode, "compiled"])],
                "replies_equal": first[mode, "eager"][1] == first[mode, "compiled"][1],
            }
            for mode in asks
        },
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.output) if args.output else ROOT / "benchmarks" / "results" / f"compiled_default_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=1) + "\n")
    print(f"{'mode':<8} {'plan':<18} {'eager tok/s':>12} {'compiled tok/s':>15} {'x eager (rounds)':>20} replies equal")
    for mode, m in report["modes"].items():
        e, c = m["tokens_per_s"]["eager"], m["tokens_per_s"]["compiled"]
        print(
            f"{mode:<8} {m['plan']:<18} {sum(e) / len(e):12.2f} {sum(c) / len(c):15.2f} "
            f"{str(m['compiled_x_eager']):>20} {m['replies_equal']}"
        )
    print(f"graphs compiled: {report['graphs']}; warm-up seconds: {warm}")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
