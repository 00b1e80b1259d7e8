"""A MARS checkpoint as vLLM's parallel drafter, measured in vLLM itself.

Runs where vLLM is installed beside mars (scripts/setup.sh --vllm), on what
`mars convert SRC --to vllm -o DIR` wrote:

    .venv/bin/mars convert weights --to vllm -o /tmp/vllm-weights
    .venv/bin/python benchmarks/vllm_drafter.py /tmp/vllm-weights

For each method (no speculation; the MARS drafter with parallel drafting; vLLM's own n-gram
prompt lookup) it starts vLLM once (float32), in a process of its own, and decodes the test prompts
greedily at batch 1 (one request at a time) and batch 8 (eight at once). It records the wall
time, the replies (the speculative ones must equal the plain ones: the target verifies every
token), and from vLLM's spec-decode counters the tokens per target step (1 + accepted drafts
per draft round) and the acceptance at each draft position. JSON goes to
benchmarks/results/vllm_<UTC time>.json, a table to stdout.

What it means: on a CPU, and on a GPU, a drafter as large as its target costs a full forward
per draft round, so the same-size pair shows the drafter's acceptance, not a speed-up; the
recipe that pays is a small MARS-trained drafter for a larger target sharing its tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("none", "mars", "ngram")


def read_prompts(path: Path, limit: int) -> list[list[dict]]:
    conversations = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            conversations.append(
                record["messages"] if "messages" in record else [{"role": "user", "content": record["prompt"]}]
            )
    return conversations[:limit]


def speculative_config(method: str, export: Path) -> dict | None:
    if method == "mars":
        return json.loads((export / "speculative_config.json").read_text())
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return None


def counters(llm) -> dict:
    """vLLM's spec-decode counters so far (zeros without speculation)."""
    found = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for metric in llm.get_metrics():
        if metric.name in names:
            found[names[metric.name]] = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["accepted_per_position"] = [int(v) for v in metric.values]
    return found


def delta(after: dict, before: dict) -> dict:
    per = [
        a - (before["accepted_per_position"][i] if i < len(before["accepted_per_position"]) else 0)
        for i, a in enumerate(after["accepted_per_position"])
    ]
    out = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    out["accepted_per_position"] = per
    out["tokens_per_target_step"] = 1 + out["accepted"] / out["drafts"] if out["drafts"] else 1.0
    out["acceptance_per_position"] = [round(a / out["drafts"], 4) for a in per] if out["drafts"] else []
    return out


def run_method(method: str, export: Path, target: str, prompts: list, batches: list[int], max_tokens: int) -> dict:
    """One method in this process: vLLM started once, every batch size decoded."""
    from vllm import LLM, SamplingParams

    spec = speculative_config(method, export)
    llm = LLM(
        model=target,
        speculative_config=spec,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max(batches),
        seed=0,
        disable_log_stats=False,
        enforce_eager=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(prompts[:1], params, use_tqdm=False)  # warm-up
    result = {"method": method, "speculative_config": spec, "batches": {}}
    for batch in batches:
        before = counters(llm)
        replies = []
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            for out in llm.chat(prompts[i : i + batch], params, use_tqdm=False):
                replies.append(list(out.outputs[0].token_ids))
        seconds = time.perf_counter() - start
        tokens = sum(len(r) for r in replies)
        result["batches"][str(batch)] = {
            "seconds": round(seconds, 3),
            "tokens": tokens,
            "tokens_per_second": round(tokens / seconds, 2),
            "replies": replies,
            **delta(counters(llm), before),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="the directory `mars convert SRC --to vllm -o DIR` wrote")
    parser.add_argument(
        "--target",
        default=None,
        help="the target model (default: DIR/target, else the drafter's target named in DIR/README.md)",
    )
    parser.add_argument("--prompts", type=Path, default=ROOT / "data" / "prompts" / "test.jsonl")
    parser.add_argument("--limit", type=int, default=16, help="the first N prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="the JSON to write (default: benchmarks/results/vllm_<UTC time>.json; '-': stdout only)",
    )
    parser.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # a child process: one method, JSON on stdout
    args = parser.parse_args()
    target = args.target or target_of(args.export)
    prompts = read_prompts(args.prompts, args.limit)
    if args.one:
        print("RESULT " + json.dumps(run_method(args.one, args.export, target, prompts, args.batch, args.max_tokens)))
        return
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    runs = []
    for method in args.methods:
        child = [
            sys.executable,
            __file__,
            str(args.export),
            "--target",
            target,
            "--prompts",
            str(args.prompts),
            "--limit",
            str(args.limit),
            "--max-tokens",
            str(args.max_tokens),
            "--batch",
            *map(str, args.batch),
            "--one",
            method,
        ]
        print(f"{method}: starting vLLM", file=sys.stderr, flush=True)
        done = subprocess.run(child, capture_output=True, text=True, env=env)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            sys.exit(f"{method}: vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        runs.append(json.loads(line[len("RESULT ") :]))
    report = summarize(runs, args, target, prompts)
    if str(args.output) != "-":
        out = args.output or ROOT / "benchmarks" / "results" / f"vllm_{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(json.dumps(report))
    print(table(report), file=sys.stderr)


def target_of(export: Path) -> str:
    if (export / "target").is_dir():
        return str((export / "target").resolve())
    import shlex

    for line in (export / "README.md").read_text().splitlines():
        if "vllm.entrypoints.openai.api_server" in line and "--model" in line:
            words = shlex.split(line)
            return words[words.index("--model") + 1]
    sys.exit(f"{export}: no target directory and no serve line in README.md; pass --target")


def summarize(runs: list[dict], args, target: str, prompts: list) -> dict:
    plain = next((r for r in runs if r["method"] == "none"), None)
    for run in runs:
        for batch, b in run["batches"].items():
            if plain is not None:
                ref = plain["batches"][batch]
                b["replies_equal_to_no_speculation"] = sum(x == y for x, y in zip(b["replies"], ref["replies"]))
                b["wall_time_vs_no_speculation"] = round(ref["seconds"] / b["seconds"], 3)
    import vllm

    return {
        "vllm": vllm.__version__,
        "target": target,
        "export": str(args.export),
        "prompts": str(args.prompts),
        "prompt_count": len(prompts),
        "max_tokens": args.max_tokens,
        "runs": runs,
    }


def table(report: dict) -> str:
    lines = [
        f"{'method':<7} {'batch':>5} {'tok/step':>8} {'tok/s':>8} {'speed':>6} {'=AR':>6}  acceptance per position"
    ]
    for run in report["runs"]:
        for batch, b in run["batches"].items():
            same = f"{b.get('replies_equal_to_no_speculation', '-')}/{len(b['replies'])}"
            lines.append(
                f"{run['method']:<7} {batch:>5} {b['tokens_per_target_step']:>8.3f} {b['tokens_per_second']:>8.1f} "
                f"{b.get('wall_time_vs_no_speculation', 1.0):>5.2f}x {same:>6}  {b['acceptance_per_position']}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
