"""Training recipes for the masks compared at equal compute, from the same starting weights.

    python benchmarks/recipes.py --work DIR [--steps 60] [--batch-size 8] [--recipes NAME,...] [--json OUT]

Each recipe continues the shipped gated adapter (--init-adapter, default weights/) for the same
number of optimizer steps at the same batch size, learning rate and schedule on the same
distilled data (--data), with `mars finetune`, and changes one thing: the objective's slot
weights, a consistency term at the mask positions, the adapter's capacity (its LoRA rank grown,
the new directions starting at zero so the grown adapter starts as the shipped one), or the
data mix (code and multi-turn records drawn more often). Then, for each, and for the starting
weights themselves:

  - teacher-forced slot agreement on the validation replies (benchmarks/slot_precision.py):
    how often the j-th mask predicts what AR would, at every block start of the replies;
  - masks-only decoding of the held-out test prompts (`mars eval`, no n-gram or corpus
    drafts): lossless tokens per forward and slot acceptance, and plain threshold 0.95's
    tokens per forward and replies identical to AR.

Two runs of the current recipe on different data orders say how far the figures move by
chance alone. Every step is kept in --work: rerun the same command and it goes on from the
first recipe not finished (a recipe's training restarts from its first step). Prints a
markdown table; --json writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MARS = [sys.executable, "-c", "import sys; from mars.cli import main; sys.exit(main())"]


@dataclass(frozen=True)
class Recipe:
    name: str
    what: str
    flags: tuple = ()  # extra `mars finetune` options
    grow_rank: int = 0  # start from the init adapter grown to this LoRA rank
    mix: bool = False  # code and multi-turn records drawn --mix-factor times as often
    seed: int = 0  # added to --seed: another data order


RECIPES = {
    r.name: r
    for r in (
        Recipe("current", "distillation KL, every slot alike (the shipped recipe)"),
        Recipe("current-seed2", "the same, another data order (chance alone)", seed=1),
        Recipe(
            "slot-weights", "slots 1-4 weighted 1, 1.5, 2, 2.5 within each row", flags=("--slot-weights", "1,1.5,2,2.5")
        ),
        Recipe(
            "consistency",
            "plus the clean stream's last hidden state as a target at the masks (weight 1)",
            flags=("--consistency", "1.0"),
        ),
        Recipe("rank-32", "LoRA rank 16 grown to 32 (alpha kept at 2 x rank)", grow_rank=32),
        Recipe("code-multiturn", "code and multi-turn records drawn 3x as often", mix=True),
    )
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list, **kw) -> None:
    shown = " ".join(str(c) for c in (["mars"] + cmd[len(MARS) :] if cmd[: len(MARS)] == MARS else cmd))
    log(f"$ {shown}")
    done = subprocess.run([str(c) for c in cmd], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kw)
    if done.returncode:
        raise SystemExit(f"recipes.py: failed (exit {done.returncode}): {shown}")


# -- what a recipe starts from ----------------------------------------------------------------------
def grow_adapter(src: Path, dest: Path, rank: int, seed: int = 0) -> Path:
    """A copy of the PEFT adapter `src` with LoRA rank `rank`: every A gains rows drawn as a fresh
    LoRA A is (uniform, bound 1/sqrt(fan-in)), every B zero columns, and alpha grows with the rank
    so alpha / rank, the deltas' scale, is kept: the grown adapter computes what `src` does."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((src / "adapter_config.json").read_text())
    old = int(config["r"])
    if rank <= old:
        raise SystemExit(f"recipes.py: --grow-rank {rank} is not above {src}'s rank {old}")
    if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise SystemExit(f"recipes.py: {src}: only a plain LoRA adapter (one rank, no rsLoRA) can be grown")
    tensors = load_file(str(src / "adapter_model.safetensors"))
    rng = np.random.default_rng(seed)
    grown = {}
    for name, t in tensors.items():
        if ".lora_A." in name:
            bound = 1.0 / np.sqrt(t.shape[1])
            extra = rng.uniform(-bound, bound, size=(rank - old, t.shape[1])).astype(t.dtype)
            grown[name] = np.concatenate([t, extra], axis=0)
        elif ".lora_B." in name:
            grown[name] = np.concatenate([t, np.zeros((t.shape[0], rank - old), t.dtype)], axis=1)
        else:
            grown[name] = t
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("training_log*", "*.png", "draft_corpus.npz"))
    save_file(grown, str(dest / "adapter_model.safetensors"))
    config["lora_alpha"] = float(config["lora_alpha"]) * rank / old
    config["r"] = rank
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest


def first_turn(record: dict) -> str:
    if "messages" in record:
        return next(m["content"] for m in record["messages"] if m["role"] == "user")
    return record.get("prompt", "")


def mixed_data(data: Path, categories: Path, dest: Path, factor: int, kinds=("code", "multi_turn")) -> dict:
    """`data`'s splits into `dest`, with every training record whose prompt the prompt file
    `categories` files under one of `kinds` written `factor` times (the trainer shuffles)."""
    kind_of = {}
    for line in categories.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            kind_of[first_turn(rec)] = rec.get("category")
    dest.mkdir(parents=True, exist_ok=True)
    counts = {"records": 0, "drawn_more": 0}
    lines = []
    for line in (data / "train.jsonl").read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        more = kind_of.get(first_turn(json.loads(line))) in kinds
        lines += [line] * (factor if more else 1)
        counts["records"] += 1
        counts["drawn_more"] += more
    random.Random(0).shuffle(lines)
    (dest / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    if (data / "valid.jsonl").is_file():
        shutil.copy(data / "valid.jsonl", dest / "valid.jsonl")
    return counts


# -- one recipe ---------------------------------------------------------------------------------------
def trained(out: Path, steps: int) -> bool:
    log_file = out / "training_log.jsonl"
    if not (out / "mars.json").is_file() or not log_file.is_file():
        return False
    lines = log_file.read_text().splitlines()
    return bool(lines) and json.loads(lines[-1]).get("step") == steps


def train(recipe: Recipe, args, work: Path) -> dict:
    out = work / recipe.name
    if not trained(out, args.steps):
        init, data = args.init_adapter, args.data
        if recipe.grow_rank:
            init = grow_adapter(args.init_adapter, work / f"init-rank{recipe.grow_rank}", recipe.grow_rank)
        if recipe.mix:
            data = work / "data-mix"
            log(f"data mix: {mixed_data(args.data, args.categories, data, args.mix_factor)}")
        if out.exists():
            shutil.rmtree(out)  # a run cut off: its training starts again
        model = ["--model", args.model] if args.model else []
        started = time.time()
        run(
            MARS
            + [
                "finetune",
                *model,
                "--data",
                data,
                "--output",
                out,
                "--init-adapter",
                init,
                "--fine-tune-type",
                "lora",
                "--gate",
                "masks",
                "--objective",
                "distill",
                "--learning-rate",
                args.learning_rate,
                "--batch-size",
                args.batch_size,
                "--iters",
                args.steps,
                "--warmup",
                0.05,
                "--steps-per-eval",
                args.steps,
                "--val-batches",
                -1,
                "--save-every",
                args.steps,
                "--max-seq-length",
                512,
                "--on-long",
                "skip",
                "--seed",
                args.seed + recipe.seed,
                "--no-draft-corpus",
                "--default-mode",
                "lossless",
                "--default-threshold",
                0.95,
                "--device",
                "cpu",
                *recipe.flags,
            ]
        )
        (out / "recipe_seconds.txt").write_text(f"{time.time() - started:.1f}\n")
    history = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    timed = out / "recipe_seconds.txt"
    return {
        "steps": history[-1]["step"],
        "val_noisy": history[-1].get("val_noisy"),
        "val_clean": history[-1].get("val_clean"),
        "train_noisy_last": history[-1].get("noisy"),
        "seconds": float(timed.read_text()) if timed.is_file() else None,
    }  # finetune's whole run: load, steps, validation


def measure(name: str, model: Path, args, work: Path) -> dict:
    """Slot agreement on the validation replies and masks-only decoding of the test prompts."""
    slots_json, eval_json = work / f"{name}.slots.json", work / f"{name}.eval.json"
    if not slots_json.is_file():
        part = slots_json.with_suffix(".part")
        run(
            [
                sys.executable,
                ROOT / "benchmarks" / "slot_precision.py",
                "--model",
                model,
                "--data",
                args.valid_data,
                *(["--limit", args.valid_limit] if args.valid_limit else []),
                "--json",
                part,
            ],
            stdout=subprocess.DEVNULL,
        )
        part.replace(slots_json)
    if not eval_json.is_file():
        part = eval_json.with_suffix(".part")
        run(
            MARS
            + [
                "eval",
                "--model",
                model,
                "--prompts",
                args.prompts,
                "--limit",
                args.limit,
                "--no-nll",
                "--max-tokens",
                args.max_tokens,
                "--threshold",
                "1.0,0.95",
                "--lossless",
                "--device",
                "cpu",
                "--output",
                part,
            ],
            stdout=subprocess.DEVNULL,
        )
        part.replace(eval_json)
    slots = json.loads(slots_json.read_text())
    rows = {
        r["mode"] + str(r["threshold"]): r
        for r in json.loads(eval_json.read_text())["models"][0]["sweep"]["thresholds"]
    }
    lossless, t95 = rows["losslessNone"], rows["threshold0.95"]
    return {
        "slot_agreement": [round(s["agree_with_ar"], 4) for s in slots["slots"][1:]],
        "lossless_tokens_per_forward": round(lossless["tokens_per_forward"], 4),
        "lossless_slot_acceptance": [round(a, 4) for a in lossless["slot_acceptance"][1:]],
        "lossless_identical": lossless["exact_match"],
        "t95_tokens_per_forward": round(t95["tokens_per_forward"], 4),
        "t95_identical": t95["exact_match"],
        "t95_agreement": round(t95["prefix_token_share"], 4),
    }


def shown(path: Path) -> str:
    """A path as the report records it: relative to the repository when inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def table(rows: list[dict]) -> str:
    lines = [
        "| recipe | slot agreement 1-4 (valid, teacher-forced) | lossless tok/fwd (test) | "
        "lossless slot acceptance 1-4 | threshold 0.95 tok/fwd, replies = AR | valid noisy loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["measured"]
        agree = " / ".join(f"{a:.3f}" for a in m["slot_agreement"])
        acc = " / ".join(f"{a:.2f}" for a in m["lossless_slot_acceptance"])
        t95 = f"{m['t95_tokens_per_forward']:.3f}, {round(m['t95_identical'] * r['prompts'])}/{r['prompts']}"
        val = "-" if r.get("train", {}).get("val_noisy") is None else f"{r['train']['val_noisy']:.4f}"
        lines.append(f"| {r['name']} | {agree} | {m['lossless_tokens_per_forward']:.3f} | {acc} | {t95} | {val} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work", type=Path, required=True, help="where every recipe's adapter and figures are kept (rerun to go on)"
    )
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of: {', '.join(RECIPES)}")
    ap.add_argument("--model", default=None, help="the base model (default: the embedded default)")
    ap.add_argument(
        "--init-adapter", type=Path, default=ROOT / "weights", help="the gated MARS adapter every recipe continues"
    )
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "distilled", help="train.jsonl (and valid.jsonl)")
    ap.add_argument(
        "--categories",
        type=Path,
        default=ROOT / "data" / "prompts" / "train.jsonl",
        help="the prompt file naming each training prompt's category (for the data-mix recipe)",
    )
    ap.add_argument("--mix-factor", type=int, default=3)
    ap.add_argument("--valid-data", type=Path, default=ROOT / "data" / "distilled" / "valid.jsonl")
    ap.add_argument(
        "--valid-limit", type=int, default=0, help="slot agreement on the first N validation replies (0: all)"
    )
    ap.add_argument("--prompts", type=Path, default=ROOT / "data" / "prompts" / "test.jsonl")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--learning-rate", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        ap.error(f"unknown recipe {unknown[0]!r}; choose from {', '.join(RECIPES)}")
    args.work.mkdir(parents=True, exist_ok=True)

    rows = [
        {
            "name": "start",
            "what": f"the starting weights ({shown(args.init_adapter)}), not trained on",
            "measured": measure("start", args.init_adapter, args, args.work),
            "prompts": args.limit,
        }
    ]
    for name in names:
        recipe = RECIPES[name]
        started = time.time()
        result = train(recipe, args, args.work)
        rows.append(
            {
                "name": name,
                "what": recipe.what,
                "flags": list(recipe.flags),
                "train": result,
                "measured": measure(name, args.work / name, args, args.work),
                "prompts": args.limit,
                "wall_seconds": round(time.time() - started, 1),
            }
        )
        log(f"{name}: {rows[-1]['measured']}")
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "init_adapter": shown(args.init_adapter),
        "data": shown(args.data),
        "prompts": shown(args.prompts),
        "limit": args.limit,
        "max_tokens": args.max_tokens,
        "valid_data": shown(args.valid_data),
        "recipes": rows,
    }
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
