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


def arguments(doc: str, argv=None) -> argparse.Namespace:
    """The options this script and head_pack.py share."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def open_sessions(args, kinds: dict) -> dict:
    """{kind: a torch CPU Session over the embedded default with these options}, `args.threads` torch
    threads; their announcements go to stderr."""
    import torch

    from mars.session import Session

    torch.set_num_threads(args.threads)
    quiet = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    return {kind: Session(None, backend="torch", device="cpu", announce=quiet, **kw) for kind, kw in kinds.items()}


def save(report: dict, name: str, args) -> Path:
    """`report` as JSON at --output, else at benchmarks/results/<name>_<UTC time>.json."""
    from mars.core.files import atomic_write_text

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.output) if args.output else ROOT / "benchmarks" / "results" / f"{name}_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=1) + "\n")
    return out


def side_by_side(sessions: dict, asks: dict, args) -> tuple[dict, dict, dict, dict]:
    """Each mode of `asks` ({mode: plan options}) decoded by each session of `sessions` ({kind:
    Session}) over the first `args.prompts` held-out test prompts, one at a time: an untimed warm-up,
    then `args.rounds` interleaved rounds (every other one in reversed order). Returns (the warm-ups'
    {(mode, kind): (plan name, replies)}, their seconds {"mode_kind": s}, tokens/s and forwards per
    round {(mode, kind): [...]}); a greedy reply that changes between rounds stops the run."""
    from mars.prompts import read_prompts

    first = next(iter(sessions.values()))
    ids = first.encode(read_prompts(ROOT / "data" / "prompts" / "test.jsonl")[: args.prompts])
    replies, warm = {}, {}
    for mode, ask in asks.items():
        for kind, s in sessions.items():
            plan = s.plan(max_tokens=args.max_tokens, **ask)
            t0 = time.perf_counter()
            replies[mode, kind] = (plan.name, s.decode(ids, plan, 1).tokens)
            warm[f"{mode}_{kind}"] = round(time.perf_counter() - t0, 1)
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
                if done.tokens != replies[mode, kind][1]:
                    raise SystemExit(f"{mode} {kind}: greedy replies changed between rounds")
                rates.setdefault((mode, kind), []).append(sum(map(len, done.tokens)) / seconds)
                forwards.setdefault((mode, kind), []).append(done.total.forwards)
    return replies, warm, rates, forwards


def compared(first: dict, rates: dict, forwards: dict, modes, new: str, old: str) -> dict:
    """side_by_side's results per mode: the plan, each kind's tokens/s and forwards per round, `new`
    against `old` per round ("<new>_x_<old>"), and whether their replies are identical."""
    return {
        mode: {
            "plan": first[mode, old][0],
            "tokens_per_s": {kind: [round(r, 3) for r in rates[mode, kind]] for kind in (old, new)},
            "forwards": {kind: forwards[mode, kind] for kind in (old, new)},
            f"{new}_x_{old}": [round(a / b, 4) for a, b in zip(rates[mode, new], rates[mode, old])],
            "replies_equal": first[mode, new][1] == first[mode, old][1],
        }
        for mode in modes
    }


def print_modes(modes: dict, new: str, old: str) -> None:
    """`compared`'s table: mean tokens/s of each kind, the ratio per round, identical replies."""
    print(f"{'mode':<9} {'plan':<18} {old + ' tok/s':>15} {new + ' tok/s':>15} {new + ' x (rounds)':>24} equal")
    for mode, m in modes.items():
        a, b = m["tokens_per_s"][old], m["tokens_per_s"][new]
        print(
            f"{mode:<9} {m['plan']:<18} {sum(a) / len(a):15.2f} {sum(b) / len(b):15.2f} "
            f"{str(m[f'{new}_x_{old}']):>24} {m['replies_equal']}"
        )


def main(argv=None) -> dict:
    args = arguments(__doc__, argv)
    sessions = open_sessions(args, {"eager": {}, "compiled": {"compile": True}})
    asks = {"ar": dict(threshold=1.0), "default": {}}
    first, warm, rates, forwards = side_by_side(sessions, asks, args)
    report = {
        "benchmark": "compiled_default",
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": vars(args),
        "warmup_seconds": warm,
        "graphs": sessions["compiled"].decoder.compiled.compiles,
        "modes": compared(first, rates, forwards, asks, "compiled", "eager"),
    }
    out = save(report, "compiled_default", args)
    print_modes(report["modes"], "compiled", "eager")
    print(f"graphs compiled: {report['graphs']}; warm-up seconds: {warm}")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
