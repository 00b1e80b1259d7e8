"""Speed and identity across number formats, side by side in one run: AR and the default mode of
the same model in torch float32 / bfloat16 (float16) and MLX float32 / 4-bit (8-bit).

    python benchmarks/formats.py [--formats torch:float32,torch:bfloat16,mlx:float32,mlx:4] [--limit 8]
        [--max-tokens 64] [--repeats 2] [--threads 1] [--feed auto|fixed] [--remeasure-cost]
        [--model DIR] [--prompts FILE] [--json OUT]

Every format is the same model: the embedded default with the shipped weights (or --model, a
float Hugging Face directory, with or without mars.json), loaded by torch in a dtype, by MLX as
it is (`mlx:float32`), or converted by `mars convert --to mlx` into a temporary directory (`mlx:4`,
`mlx:8`: quantized in groups of --group-size; `mlx:bfloat16`: cast) and opened with the shipped
adapter. Each format decodes the first --limit held-out test prompts (chat template, greedy,
batch 1) in two modes: AR (threshold 1.0) and the checkpoint's default plan with the draft
sources `mars generate` feeds with no options (the shipped weights: lossless greedy with n-gram
drafts, the checkpoint's corpus drafts, runner-up alternatives and the cost-aware feed; a model
without mars.json: lossless; `Session.plan` alone would feed the masks only). Cost curves are
measured or read before anything is timed; each (format, mode) pair decodes one prompt as a
warm-up; then --repeats rounds run every pair in turn, every other round in reverse, so that a
shared machine's drift hits all alike. Speeds are medians over the rounds; ratios are taken
within a round, then their median (min-max) reported.

Identity: the default mode's replies against AR's in the same format (mars.parity: identical
replies, each divergence's position and AR's top-2 logit gap there, in the format's ulps), and
each format's AR replies against float32 AR of the same backend: information, not a fault, as a
narrower or quantized format is another arithmetic of the model and may pick another token where
its two best logits nearly tie. Prints a markdown table; --json writes every figure and reply.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FORMATS = "torch:float32,torch:bfloat16,mlx:float32,mlx:4"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
MODES = ("ar", "default")


@dataclass
class Format:
    """One number format of the model: `spec` as given (torch:bfloat16, mlx:4) and what decodes in it."""

    spec: str
    backend: str
    dtype: str | None = None  # torch's dtype; MLX: the float type to cast to (None: the model's own)
    bits: int | None = None  # MLX: quantized to this many bits
    session: object = None
    ids: list = field(default_factory=list)
    plans: dict = field(default_factory=dict)
    load_s: float = 0.0
    curve: dict | None = None  # the one-row cost curve the default mode's feed starts from (tokens -> s)
    runs: dict = field(default_factory=lambda: {m: [] for m in MODES})  # mode -> one Decoded per round

    @property
    def reference(self) -> str:
        """The format this one's cross-format figures are taken against."""
        return f"{self.backend}:float32"


def parse_formats(text: str) -> list[Format]:
    out = []
    for spec in (s.strip() for s in text.split(",")):
        backend, _, kind = spec.partition(":")
        if backend in ("torch", "mlx") and kind in FLOAT_DTYPES:
            out.append(Format(spec, backend, dtype=kind))
        elif backend == "mlx" and kind.isdigit():
            out.append(Format(spec, backend, bits=int(kind)))
        else:
            raise SystemExit(
                f"--formats: {spec!r} is not a format; use torch:{{{','.join(FLOAT_DTYPES)}}} or "
                f"mlx:{{{','.join(FLOAT_DTYPES)}}} or mlx:BITS (4, 8), e.g. {DEFAULT_FORMATS}"
            )
    if len({f.spec for f in out}) != len(out):
        raise SystemExit(f"--formats: a format is named twice in {text!r}")
    return out


def open_format(fmt: Format, model: Path | None, tmp: Path, args, say) -> None:
    """Load `fmt`'s session (converting for MLX formats other than the directory as it is)."""
    from mars.checkpoint.default_model import default_model_dir, shipped_weights
    from mars.convert import convert_model
    from mars.session import Session

    t0 = time.perf_counter()
    common = dict(announce=say, remeasure_cost=args.remeasure_cost)
    if fmt.backend == "torch":
        fmt.session = Session(model and str(model), backend="torch", dtype=fmt.dtype, **common)
    elif fmt.bits is None and fmt.dtype == "float32":
        fmt.session = Session(model and str(model), backend="mlx", **common)
    else:
        # mlx-lm's own layout, quantized or cast; without --model the shipped adapter goes on top of it
        # (the mask row kept beside a quantized embedding), as a user of a quantized base would run it.
        out = convert_model(
            model or default_model_dir(),
            tmp / fmt.spec.replace(":", "-"),
            "mlx",
            dtype=fmt.dtype,
            q_bits=fmt.bits,
            q_group_size=args.group_size,
            announce=say,
        )
        adapter = None if model else shipped_weights()
        fmt.session = Session(str(out), adapter_path=adapter and str(adapter), backend="mlx", **common)
    fmt.load_s = time.perf_counter() - t0


def make_plans(fmt: Format, max_tokens: int, feed: str) -> None:
    """AR and the default mode: the checkpoint's plan, or lossless for a model without mars.json
    (its masks are untrained, which lossless decoding tolerates: the output stays AR's), with the
    draft sources `mars generate` feeds by default."""
    from mars.core.acceptance import ar_threshold
    from mars.core.decode.plan import Mode
    from mars.core.decode.rules import DEFAULT_ALTERNATIVES, DEFAULT_NGRAM

    s = fmt.session
    # Session.plan's draft sources default to none (masks only); the CLI's options default to these,
    # and with n-gram drafts on the checkpoint's draft corpus drafts too.
    drafts = dict(ngram=DEFAULT_NGRAM, alternatives=DEFAULT_ALTERNATIVES)
    default = s.plan(max_tokens=max_tokens, feed=feed, **drafts, **({} if s.mars is not None else {"lossless": True}))
    ar = s.plan(threshold=ar_threshold(default.metric), max_tokens=max_tokens, feed=feed)
    assert ar.mode is Mode.AR, ar.name
    fmt.plans = {"ar": ar, "default": default}


def prepared_curve(fmt: Format) -> dict | None:
    """Measure (or read the kept) cost curve now, outside the timed rounds; a copy of its points, as
    decoding refreshes the live curve from the forwards it times."""
    s, plan = fmt.session, fmt.plans["default"]
    s.prepare_feed(plan, 1)
    return dict(s.controller.costs.one.points) if s.controller.uses(plan) else None


def drafts_of(plan) -> dict:
    d = plan.drafts
    return {
        "ngram": d.ngram,
        "corpus": d.corpus is not None and d.ngram > 0,
        "alternatives": d.alternatives,
        "spare_groups_cap": d.hedge,
        "feed": plan.feed,
    }


def median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def equal_replies(a: list[list[int]], b: list[list[int]]) -> dict:
    """Replies of `a` identical to `b`'s, prompt by prompt, and the share of `b`'s tokens `a` kept before
    its first difference."""
    from mars.parity import common_prefix

    kept = sum(common_prefix(x, y) for x, y in zip(a, b))
    return {
        "identical": sum(x == y for x, y in zip(a, b)),
        "replies": len(b),
        "prefix_share": round(kept / max(1, sum(len(y) for y in b)), 4),
    }


def speeds(fmt: Format, mode: str) -> list[float]:
    return [sum(len(t) for t in d.tokens) / d.seconds for d in fmt.runs[mode]]


def mode_report(fmt: Format, mode: str) -> dict:
    runs = fmt.runs[mode]
    total = runs[0].total
    first = runs[0].tokens
    return {
        "plan": fmt.plans[mode].name,
        **({"drafts": drafts_of(fmt.plans[mode])} if mode == "default" else {}),
        "tokens": sum(len(t) for t in first),
        "seconds": [d.seconds for d in runs],
        "tokens_per_s": median_range(speeds(fmt, mode)),
        "tokens_per_forward": round(total.tokens_per_forward, 4),
        "tokens_by_source": total.by_source() or None,
        # A greedy mode repeats itself; a lossless feed that learns across calls may round otherwise in a narrow
        # format from round to round. Replies that differ from round 1's, over every later round.
        "replies_changed_after_round_1": sum(t != f for d in runs[1:] for t, f in zip(d.tokens, first)),
        "replies": first,
    }


def report_of(formats: list[Format], args, argv: list[str], prompts, started: dict, load: tuple) -> dict:
    import torch

    from mars.parity import parity

    by_spec = {f.spec: f for f in formats}
    out = {}
    for f in formats:
        s = f.session
        ar, default = f.runs["ar"][0].tokens, f.runs["default"][0].tokens
        r = {
            "format": f.spec,
            "computes_in": parity_format(s),
            "model": getattr(s.loaded, "path", None),
            "load_s": round(f.load_s, 2),
            "ar": mode_report(f, "ar"),
            "default": mode_report(f, "default"),
            "default_over_ar": median_range([d / a for d, a in zip(speeds(f, "default"), speeds(f, "ar"))]),
            # Untimed, after the rounds: one plain forward per reply that left AR's.
            "parity": parity(s.decoder, s.loaded, f.ids, ar, default),
            "cost_curve": f.curve,
        }
        earlier = formats[: formats.index(f)]
        shared = next((g.spec for g in earlier if g.curve is not None and g.curve == f.curve), None)
        if shared is not None:
            # Measured curves do not repeat to the last digit: this format read the kept file the earlier one
            # measured or read (mars.backends.base.cost_curve's key), not a curve of its own.
            r["cost_curve_read_from"] = shared
        ref = by_spec.get(f.reference)
        if ref is not None and ref is not f:
            r["ar_equal_to_float32_ar"] = {"reference": ref.spec, **equal_replies(ar, ref.runs["ar"][0].tokens)}
            r["over_float32"] = {m: median_range([a / b for a, b in zip(speeds(f, m), speeds(ref, m))]) for m in MODES}
        out[f.spec] = r
    torch32, mlx32 = by_spec.get("torch:float32"), by_spec.get("mlx:float32")
    try:
        import mlx.core as mx

        mlx_version = mx.__version__
    except ImportError:
        mlx_version = None
    return {
        "started_utc": started["utc"],
        "argv": argv,
        "model": str(args.model) if args.model else "default (embedded SmolLM2-135M-Instruct + shipped weights)",
        "prompts": str(args.prompts),
        "limit": len(prompts),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "batch_size": 1,
        "feed": args.feed,
        "remeasure_cost": args.remeasure_cost,
        "torch_threads": args.threads,
        "machine": {
            "processor": cpu_name(),
            "cpus": os.cpu_count(),
            "load_average_before": load[0],
            "load_average_after": load[1],
        },
        "versions": {"torch": torch.__version__, "mlx": mlx_version},
        "git": started["git"],  # the code this run imported
        "formats": out,
        # Two backends' float32 arithmetic in different kernels: equal unless a near-tie falls otherwise.
        "mlx_float32_ar_equal_to_torch_float32_ar": (
            equal_replies(mlx32.runs["ar"][0].tokens, torch32.runs["ar"][0].tokens) if torch32 and mlx32 else None
        ),
    }


def git_state() -> dict | None:
    """The commit, and the files that differ from it: others may be changing mars/ while a run goes on."""
    import subprocess

    try:

        def git(*a):
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout

        commit, changed = git("rev-parse", "--short", "HEAD").strip(), git("status", "--porcelain").splitlines()
        return {"commit": commit, "changed": changed}
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_name() -> str:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
        return line.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def parity_format(session) -> str:
    from mars.parity import number_format

    return number_format(session.loaded)[0]


def describe(drafts: dict) -> str:
    parts = [f"n-gram drafts {drafts['ngram']}" if drafts["ngram"] else "no n-gram drafts"]
    parts += ["corpus drafts"] if drafts["corpus"] else []
    parts += [f"alternatives {drafts['alternatives']}", f"feed {drafts['feed']}"]
    return ", ".join(parts)


def ratio_cell(r: dict) -> str:
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def table(report: dict) -> str:
    from mars.parity import GAP_MEANING, summary

    rows = report["formats"].values()
    lines = [
        f"{report['limit']} prompts x {report['max_tokens']} tokens, batch 1, median of {report['repeats']} "
        f"interleaved rounds, torch threads {report['torch_threads']}, feed {report['feed']}",
        "",
        "| format | AR tok/s | default tok/s | default / AR (min-max) | tokens/forward | default = AR "
        "| AR = float32 AR |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["parity"]
        same = r.get("ar_equal_to_float32_ar")
        if same:
            same = f"{same['identical']}/{same['replies']}"
        else:  # float32 itself, or a format whose backend's float32 is not in this run
            same = "(itself)" if r["format"] == f"{r['format'].split(':')[0]}:float32" else "-"
        lines.append(
            f"| {r['computes_in']} | {r['ar']['tokens_per_s']['median']:.1f} "
            f"| {r['default']['tokens_per_s']['median']:.1f} | {ratio_cell(r['default_over_ar'])} "
            f"| {r['default']['tokens_per_forward']:.2f} | {p['identical']}/{p['replies']} "
            f"| {same} |"
        )
    crossed = [r for r in rows if "over_float32" in r]
    if crossed:
        lines += ["", "| tokens/s ratio (min-max) | AR | default mode |", "|---|---|---|"]
        for r in crossed:
            ref = report["formats"][r["ar_equal_to_float32_ar"]["reference"]]["computes_in"]
            lines.append(
                f"| {r['computes_in']} / {ref} | {ratio_cell(r['over_float32']['ar'])} "
                f"| {ratio_cell(r['over_float32']['default'])} |"
            )
    drafts = "; ".join(dict.fromkeys(describe(r["default"]["drafts"]) for r in rows))
    plans = "; ".join(f"{r['computes_in']}: {r['default']['plan']}" for r in rows)
    lines += ["", f"default mode ({drafts}): {plans}. Parity with AR in each format:"]
    lines += [f"- {summary(r['parity'])}" for r in rows]
    if any(r["parity"]["divergences"] for r in rows):
        lines.append(GAP_MEANING)
    if crossed:
        lines.append(
            "AR = float32 AR is information, not a fault: a narrower or quantized format computes another "
            "model's arithmetic, so its greedy replies may part from float32's where two logits nearly tie "
            "(and quantized weights move the logits themselves)."
        )
    same = report["mlx_float32_ar_equal_to_torch_float32_ar"]
    if same:
        lines.append(f"mlx float32 AR = torch float32 AR: {same['identical']}/{same['replies']}.")
    for r in rows:
        if r["default"]["replies_changed_after_round_1"]:
            lines.append(
                f"{r['format']}: {r['default']['replies_changed_after_round_1']} default-mode replies changed "
                "after round 1 (parity is round 1's)."
            )
        if "cost_curve_read_from" in r:
            lines.append(
                f"{r['format']}'s feed decided on {r['cost_curve_read_from']}'s cost curve (the same kept "
                "file: its cache key does not tell these formats apart; --remeasure-cost measures each "
                "format's own in this run)."
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help=f"comma-separated (default {DEFAULT_FORMATS})")
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a float HF model directory instead of the embedded default with the shipped weights",
    )
    ap.add_argument("--prompts", type=Path, default=ROOT / "data" / "prompts" / "test.jsonl")
    ap.add_argument("--limit", type=int, default=8, help="the first N prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds after the warm-up")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: steadier on a shared machine; MLX picks its own)",
    )
    ap.add_argument(
        "--feed",
        choices=("auto", "fixed"),
        default="auto",
        help="the default mode's feed: auto (the cost-aware one, as mars generate runs) or fixed "
        "(no cost curve measured)",
    )
    ap.add_argument(
        "--remeasure-cost",
        action="store_true",
        help="measure every format's cost curve in this run instead of reading the kept ones",
    )
    ap.add_argument("--group-size", type=int, default=64, help="MLX quantization group size")
    ap.add_argument("--json", type=Path, default=None, help="write the figures and replies here")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if min(args.limit, args.max_tokens, args.repeats, args.threads) < 1:
        ap.error("--limit, --max-tokens, --repeats and --threads must be >= 1")
    formats = parse_formats(args.formats)

    import torch

    from mars.cli.common import quiet_libraries
    from mars.prompts import read_prompts

    quiet_libraries()  # transformers' progress bars and warnings would bury the per-pass lines
    torch.set_num_threads(args.threads)
    started = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": git_state()}
    load_before = os.getloadavg()
    prompts = read_prompts(args.prompts)[: args.limit]

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="formats-") as tmp:
        for f in formats:
            open_format(f, args.model, Path(tmp), args, say)
            f.ids = f.session.encode(prompts)
            make_plans(f, args.max_tokens, args.feed)
            f.curve = prepared_curve(f)
            say(
                f"{f.spec}: {parity_format(f.session)}, loaded in {f.load_s:.1f} s; "
                f"default mode {f.plans['default'].name}"
            )
        pairs = [(f, mode) for f in formats for mode in MODES]
        for f, mode in pairs:  # warm-up: allocations, MLX's first graphs, the feed policy's first steps
            f.session.decode(f.ids[:1], f.plans[mode], batch_size=1)
        for r in range(args.repeats):
            for f, mode in pairs if r % 2 == 0 else pairs[::-1]:
                d = f.session.decode(f.ids, f.plans[mode], batch_size=1)
                f.runs[mode].append(d)
                n = sum(len(t) for t in d.tokens)
                say(
                    f"round {r + 1}/{args.repeats}: {f.spec} {mode} {n} tokens in {d.seconds:.1f} s "
                    f"({n / d.seconds:.1f} tokens/s)"
                )
        report = report_of(formats, args, argv, prompts, started, (load_before, os.getloadavg()))
    print(table(report), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        say(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
