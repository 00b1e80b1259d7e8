"""The LM head's reads through its pack (packed.pack_head) against `F.linear`: the product alone, then
whole decoding on the embedded default.

    python benchmarks/head_pack.py                    # 4 test prompts x 64 tokens, 2 rounds, 1 thread
    python benchmarks/head_pack.py --prompts 8 --rounds 3

1. The head's product alone: the default model's head weight (49,152 x 576, float32) over 1, 2, 3,
   4, 5, 9, 17 and 33 rows, `F.linear` against mars's path for that many reads (base.head_logits:
   one row runs `F.linear`, more the pack), interleaved, the median of 8 calls each.
2. Whole decoding: two eager sessions over the default model, one with its head packed (as the
   torch decoder makes it on a CPU in float32), one with the pack dropped, decode the first N
   held-out test prompts one at a time: AR, lossless, and the checkpoint's default mode, after a
   warm-up, in interleaved rounds (every other one in reversed order). The replies of the two
   must be identical (`replies_equal`).

Prints a table; writes JSON to --output (default benchmarks/results/head_pack_<UTC time>.json).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from compiled_default import arguments, compared, open_sessions, print_modes, save, side_by_side

ROOT = Path(__file__).resolve().parent.parent
ROWS = (1, 2, 3, 4, 5, 9, 17, 33)
REPEATS = 9  # calls of each product; the first of each is dropped


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
    args = arguments(__doc__, argv)
    sessions = open_sessions(args, {"packed": {}, "unpacked": {}})
    from mars.backends.torch import packed

    head = sessions["packed"].decoder.head
    if "_mars_packed" not in head.__dict__:
        raise SystemExit("the decoder did not pack the head (not a float32 CPU decoder with oneDNN)")
    packed.unpack_linears(sessions["unpacked"].decoder.head)
    products = product_ms(head, REPEATS)
    asks = {"ar": dict(threshold=1.0), "lossless": dict(lossless=True), "default": {}}
    first, _, rates, forwards = side_by_side(sessions, asks, args)
    report = {
        "benchmark": "head_pack",
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": vars(args),
        "head": list(head.weight.shape),
        "product_ms": {str(r): {**t, "linear_x_mars": round(t["linear"] / t["mars"], 3)} for r, t in products.items()},
        "modes": compared(first, rates, forwards, asks, "packed", "unpacked"),
    }
    out = save(report, "head_pack", args)
    print(f"{'rows':>4} {'F.linear ms':>12} {'mars ms':>8} {'x':>6}")
    for r, t in report["product_ms"].items():
        print(f"{r:>4} {t['linear']:12.2f} {t['mars']:8.2f} {t['linear_x_mars']:6.2f}")
    print_modes(report["modes"], "packed", "unpacked")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
