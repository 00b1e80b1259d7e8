"""The LM head's reads through its pack (packed.pack_head) against `F.linear`: the product alone, then
whole decoding on the embedded default.

    python benchmarks/head_pack.py                    # 4 test prompts x 64 tokens, 2 rounds, 1 thread
    python benchmarks/head_pack.py --prompts 8 --rounds 3

1. The head's product alone: the default model's head weight (49,152 x 576, float32) over 1, 2, 3,
   4, 5, 9, 17 and 33 rows, `F.linear` against mars's path for that many reads (base.head_logits:
   one row runs `F.linear`, more the pack), interleaved, the median of `--repeats` calls each.
2. Whole decoding: two eager sessions over the default model, one with its head packed (as the
   torch decoder makes it on a CPU in float32), one with the pack dropped, decode the first N
   held-out test prompts one at a time: AR, lossless, and the checkpoint's default mode, after a
   warm-up, in interleaved rounds (every other one in reversed order). The replies of the two
   must be identical (`replies_equal`).

Prints a table; writes JSON to --output (default benchmarks/results/head_pack_<UTC time>.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = (1, 2, 3, 4, 5, 9, 17, 33)


def product_ms(head, repeats: int) -> dict:
    """{rows: {"linear": ms, "mars": ms}} for the head's product alone."""
    import torch
    import torch.nn.functional as F

    from mars.backends.torch.models.base import head_logits

    gen = torch.Generator().manual_seed(0)
    times: dict[int, dict[str, list[float]]] = {r: {"linear": [], "mars": []} for r in ROWS}
    inputs = {r: torch.randn(r, head.in_features, generator=gen) for r in ROWS}
    with torch.inference_mode():
        for _ in range(repeats):
            for r in ROWS:
                x = inputs[r]
                for name, run in (("linear", lambda: F.linear(x, head.weight)), ("mars", lambda: head_logits(head, x))):
                    t0 = time.perf_counter()
                    run()
                    times[r][name].append((time.perf_counter() - t0) * 1e3)
    return {r: {k: round(statistics.median(v[1:]), 3) for k, v in t.items()} for r, t in times.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from mars.backends.torch import packed
    from mars.core.files import atomic_write_text
    from mars.prompts import read_prompts
    from mars.session import Session

    quiet = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    sessions = {
        "packed": Session(None, backend="torch", device="cpu", announce=quiet),
        "unpacked": Session(None, backend="torch", device="cpu", announce=quiet),
    }
    head = sessions["packed"].decoder.head
    if "_mars_packed" not in head.__dict__:
        raise SystemExit("the decoder did not pack the head (not a float32 CPU decoder with oneDNN)")
    packed.unpack_linears(sessions["unpacked"].decoder.head)
    products = product_ms(head, args.repeats)

    ids = sessions["packed"].encode(read_prompts(ROOT / "data" / "prompts" / "test.jsonl")[: args.prompts])
    asks = {"ar": dict(threshold=1.0), "lossless": dict(lossless=True), "default": {}}
    first = {}
    for mode, ask in asks.items():
        for kind, s in sessions.items():
            plan = s.plan(max_tokens=args.max_tokens, **ask)
            first[mode, kind] = (plan.name, s.decode(ids, plan, 1).tokens)
    rates: dict[tuple[str, str], list[float]] = {}
    forwards: dict[tuple[str, str], list[int]] = {}
    for rnd in range(args.rounds):
        for mode, ask in asks.items():
            kinds = list(sessions.items())
            for kind, s in kinds if rnd % 2 == 0 else kinds[::-1]:
                plan = s.plan(max_tokens=args.max_tokens, **ask)
                t0 = time.perf_counter()
                done = s.decode(ids, plan, 1)
                seconds = time.perf_counter() - t0
                rates.setdefault((mode, kind), []).append(sum(map(len, done.tokens)) / seconds)
                forwards.setdefault((mode, kind), []).append(done.total.forwards)
    report = {
        "benchmark": "head_pack",
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": vars(args),
        "head": list(head.weight.shape),
        "product_ms": {str(r): {**t, "linear_x_mars": round(t["linear"] / t["mars"], 3)} for r, t in products.items()},
        "modes": {
            mode: {
                "plan": first[mode, "packed"][0],
                "tokens_per_s": {kind: [round(r, 3) for r in rates[mode, kind]] for kind in sessions},
                "forwards": {kind: forwards[mode, kind] for kind in sessions},
                "packed_x_unpacked": [round(a / b, 4) for a, b in zip(rates[mode, "packed"], rates[mode, "unpacked"])],
                "replies_equal": first[mode, "packed"][1] == first[mode, "unpacked"][1],
            }
            for mode in asks
        },
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.output) if args.output else ROOT / "benchmarks" / "results" / f"head_pack_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=1) + "\n")
    print(f"{'rows':>4} {'F.linear ms':>12} {'mars ms':>8} {'x':>6}")
    for r, t in report["product_ms"].items():
        print(f"{r:>4} {t['linear']:12.2f} {t['mars']:8.2f} {t['linear_x_mars']:6.2f}")
    print(f"{'mode':<9} {'plan':<18} {'packed tok/s':>13} {'unpacked tok/s':>15} {'packed x (rounds)':>22} equal")
    for mode, m in report["modes"].items():
        a, b = m["tokens_per_s"]["packed"], m["tokens_per_s"]["unpacked"]
        print(
            f"{mode:<9} {m['plan']:<18} {sum(a) / len(a):13.2f} {sum(b) / len(b):15.2f} "
            f"{str(m['packed_x_unpacked']):>22} {m['replies_equal']}"
        )
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
