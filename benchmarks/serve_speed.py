"""`mars serve`'s engine against our own AR, side by side: requests one at a time and several
in flight, in each of the server's decoding modes.

    python benchmarks/serve_speed.py                       # 8 held-out test prompts, 128 tokens
    python benchmarks/serve_speed.py --limit 16 --concurrency 1,4 --repeats 3

Each configuration (a mode: lossless, threshold 1.0, a threshold below it; a cache: window,
the default of `mars serve`, or block, `--cache block`; a concurrency) sends the prompts through the server's engine
(`mars.serve.build`, as `mars serve` runs it, without HTTP): with concurrency c, c requests are in flight at a
time, a new one submitted as one ends. The baseline is `generate` at threshold 1.0 on the
window cache (`mars generate --threshold 1.0`, our AR), one prompt at a time. Rounds are
interleaved (every other one in reverse order) so the machine's drift hits all alike; the
ratio is the median over rounds of each round's AR wall time over the configuration's.
Every reply is compared with AR's (identical for lossless and threshold 1.0 by construction).
Prints a table; writes JSON to --output (default benchmarks/results/serve_speed_<UTC time>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded default with its MARS weights")
    p.add_argument("--prompts", default=str(ROOT / "data" / "prompts" / "test.jsonl"))
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,4", help="requests in flight, comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threshold", type=float, default=0.95, help="the threshold-mode configuration's threshold")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: quiet, comparable timings)")
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


async def _serve(engine, ids, max_tokens, extra, concurrency):
    """Every prompt through the engine, `concurrency` in flight; returns the replies' tokens."""
    from mars.core.decode.plan import Sampling
    from mars.serve.engine import Job

    loop = asyncio.get_running_loop()
    out: list[list[int] | None] = [None] * len(ids)
    todo = list(range(len(ids)))

    async def worker():
        while todo:
            i = todo.pop(0)
            box = engine.new_outbox(loop)
            engine.submit(Job(prompt=ids[i], max_tokens=max_tokens, outbox=box, sampling=Sampling(), **extra))
            tokens = []
            while True:
                new, _, finish = await box.take()
                tokens += new
                if finish is not None:
                    break
            if finish not in ("eos", "length"):
                raise RuntimeError(f"request {i} ended {finish}: {box.error}")
            out[i] = tokens

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def main(argv):
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    from mars.core.decode.loop import generate
    from mars.prompts import read_prompts
    from mars.serve import EngineLimits, build
    from mars.session import Session

    session = Session(args.model, announce=lambda m: print(m, file=sys.stderr))
    ids = session.encode(read_prompts(args.prompts)[: args.limit], chat=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    ar_settings = session.plan(threshold=1.0, max_tokens=args.max_tokens)
    eos = set(session.loaded.eos_ids)

    def strip(t):
        return t[:-1] if t and t[-1] in eos else t

    engines = {}
    for cache in ("window", "block"):
        # A session of its own per engine (the same weights): each engine's feed policies learn apart.
        served = Session.from_loaded(session.loaded, announce=session.announce)
        _, engine = build(served, name="bench", engine_limits=EngineLimits(max_batch=max(levels), cache=cache))
        engine.prepare_feed(announce=lambda m: print(m, file=sys.stderr))
        engine.start()
        engines[cache] = engine
    configs = [("AR (generate, window cache)", None, None)]
    modes = [
        ("lossless", dict(lossless=True)),
        ("threshold 1.0", dict(threshold=1.0, pinned=True)),
        (f"threshold {args.threshold:g}", dict(threshold=args.threshold, pinned=True)),
    ]
    for c in levels:
        for mode, extra in modes:
            for cache in ("window", "block"):
                configs.append((f"serve {mode}, {cache} cache, {c} in flight", cache, (extra, c)))

    def run(config):
        name, cache, spec = config
        t0 = time.perf_counter()
        if spec is None:
            out = [generate(session.decoder, [p], ar_settings).tokens[0] for p in ids]
        else:
            extra, c = spec
            out = asyncio.run(_serve(engines[cache], ids, args.max_tokens, extra, c))
        return time.perf_counter() - t0, [strip(t) for t in out]

    run(configs[0])  # warm up
    walls = {c[0]: [] for c in configs}
    replies = {}
    for r in range(args.repeats):
        order = configs if r % 2 == 0 else configs[::-1]
        for config in order:
            wall, out = run(config)
            walls[config[0]].append(wall)
            replies[config[0]] = out
            print(f"round {r + 1}: {config[0]}: {wall:.1f} s", file=sys.stderr)
    for engine in engines.values():
        engine.stop()
    ar_name = configs[0][0]
    ar = replies[ar_name]
    tokens = sum(len(t) for t in ar)
    rows = []
    for name, *_ in configs:
        ratios = [a / w for a, w in zip(walls[ar_name], walls[name])]
        same = sum(o == a for o, a in zip(replies[name], ar))
        prefix = sum(
            next((k for k, (x, y) in enumerate(zip(o, a)) if x != y), min(len(o), len(a)))
            for o, a in zip(replies[name], ar)
        )
        rows.append(
            {
                "name": name,
                "wall_s": statistics.median(walls[name]),
                "walls": walls[name],
                "tokens": sum(len(t) for t in replies[name]),
                "tokens_per_s": sum(len(t) for t in replies[name]) / statistics.median(walls[name]),
                "ratio_to_ar": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "replies_equal_to_ar": same,
                "ar_prefix_kept": prefix / tokens,
            }
        )
    report = {
        "prompts": args.prompts,
        "limit": args.limit,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "model": args.model or "default",
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    out = (
        Path(args.output)
        if args.output
        else ROOT / "benchmarks" / "results" / f"serve_speed_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print("| configuration | tokens/s | x AR (min-max) | = AR | AR prefix |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['tokens_per_s']:.1f} | {r['ratio_to_ar']:.2f} "
            f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) "
            f"| {r['replies_equal_to_ar']}/{len(ids)} | {r['ar_prefix_kept']:.3f} |"
        )
    print(f"JSON: {out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
