"""Teacher-forced precision of the mask slots: how often each slot agrees with the model's own
AR prediction, how confident it is, and what a threshold would accept at what precision.

    python benchmarks/slot_precision.py [--model M] --data FILE.jsonl [--limit N] [--json OUT]

Cheaper than decoding (one training forward per batch, no generation) and finer: decoding
reports how far the output stays equal to AR; this reports why. At every block start t inside
a response (the contexts training sees), the window's slot 0 is the clean stream's prediction
of token t and slot j >= 1 the j-th mask's prediction of token t + j; each is compared with
the model's own AR (clean-stream) prediction of that token given the true text before it.
The threshold table replays the acceptance rule (docs/method.md §5, the checkpoint's metric or
--metric) on those slots: tokens per step, the precision of the accepted extra tokens, the
share of steps that accept a wrong one. --compare-metrics replays all three metrics on a fine
threshold grid and prints, for each, the most tokens per step whose share of steps with a
wrong token stays within a budget: which metric buys more tokens at equal risk. Torch
backend. Prints a table; --json writes the figures.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from mars.core.acceptance import METRICS, is_ar_mode, passes

DEFAULT_THRESHOLDS = {
    "probability": (0.99, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5),
    "margin": (0.98, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4),
    "entropy": (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5),
}
ERROR_BUDGETS = (0.005, 0.01, 0.02, 0.05, 0.1)


def slot_records(session, examples, batch_size: int = 8, metrics=("probability",)):
    """({metric: confidence (n, B+1)}, pred (n, B+1), ar (n, B+1) with -1 where the slot's
    token is unlabelled) over every labelled block start of `examples`. Confidences are the
    decoder's own (greedy `slot_predictions`)."""
    import torch

    from mars.backends.torch.decode import slot_predictions
    from mars.backends.torch.forward import additive_mask
    from mars.backends.torch.loss import MarsLoss
    from mars.core.decode.plan import Sampling
    from mars.core.loss import IGNORE
    from mars.core.masks import training_inputs
    from mars.core.train.data import batches
    from mars.evaluate import response_labels

    B, mask_id = session.block_size(), session.mask_id()
    eos = session.loaded.tokenizer.eos_token_id
    module = MarsLoss(session.loaded.model, gate=session.loaded.gate)
    confs, preds, refs = {m: [] for m in metrics}, [], []
    dev = session.loaded.device
    with torch.inference_mode():
        for ids, labels, lengths in batches(examples, batch_size, pad_id=eos, shuffle=False):
            labels = response_labels(labels, eos)
            L = ids.shape[1]
            inp, pos, mask = training_inputs(ids, labels, lengths, B, mask_id)
            hidden = module.hidden(
                torch.from_numpy(inp).to(dev),
                torch.from_numpy(pos).to(dev),
                additive_mask(mask, session.loaded.dtype, dev),
            )
            for r in range(ids.shape[0]):
                starts = [t for t in range(B, L, B) if labels[r, t] != IGNORE]
                if not starts:
                    continue
                slot_at, ar_at, valid = [], [], []
                for t in starts:
                    for s in range(B + 1):
                        slot_at.append(
                            L + t - 1 if s == 0 else t + s - 1
                        )  # docs/method.md §4: output at i predicts p(i) + 1
                        j = t + s
                        valid.append(j < L and labels[r, j] != IGNORE)
                        ar_at.append(L + min(j, L - 1) - 1)
                logits = module.head(hidden[r, slot_at]).float()
                ar = module.head(hidden[r, ar_at]).float().argmax(-1).cpu().numpy()
                ar[~np.array(valid)] = -1
                shape = (len(starts), B + 1)
                for m in metrics:
                    ids, conf = slot_predictions(logits, m, Sampling())
                    confs[m].append(conf.cpu().numpy().reshape(shape))
                preds.append(ids.cpu().numpy().reshape(shape))
                refs.append(ar.reshape(shape))
    if not preds:
        raise ValueError("no labelled block start in the data")
    return {m: np.concatenate(c) for m, c in confs.items()}, np.concatenate(preds), np.concatenate(refs)


def replay(conf, pred, ref, metric: str, tau: float) -> dict:
    """The acceptance rule on teacher-forced slots: tokens per step, precision of the accepted
    extra tokens, share of steps that accepted a wrong one."""
    B = conf.shape[1] - 1
    valid = ref >= 0
    right = (pred == ref) & valid
    going = np.ones(len(conf), bool)
    tokens = np.ones(len(conf))
    good = np.zeros(len(conf))
    wrong = np.zeros(len(conf), bool)
    for s in range(1, B + 1) if not is_ar_mode(metric, tau) else ():  # AR mode: slot 0 only, by rule
        going &= valid[:, s] & passes(conf[:, s], metric, tau)
        tokens += going
        good += going & right[:, s]
        wrong |= going & ~right[:, s]
    extra = tokens.sum() - len(conf)
    return {
        "threshold": tau,
        "tokens_per_step": float(tokens.mean()),
        "precision": float(good.sum() / extra) if extra else None,
        "steps_with_error": float(wrong.mean()),
    }


def compare_metrics(confs: dict, pred, ref, budgets=ERROR_BUDGETS, grid: int = 200) -> dict:
    """Per metric and error budget: the threshold (on a fine grid) that accepts the most tokens
    per step while the share of steps with a wrong accepted token stays within the budget."""
    out = {}
    for m, conf in confs.items():
        valid = conf[:, 1:][ref[:, 1:] >= 0]
        grid_taus = np.unique(np.quantile(valid, np.linspace(0, 1, grid))) if valid.size else np.array([])
        runs = [replay(conf, pred, ref, m, float(t)) for t in grid_taus]
        best = []
        for b in budgets:
            fit = [r for r in runs if r["steps_with_error"] <= b]
            top = max(fit, key=lambda r: r["tokens_per_step"], default=None)
            best.append(
                {
                    "budget": b,
                    **(top or {"threshold": None, "tokens_per_step": 1.0, "precision": None, "steps_with_error": 0.0}),
                }
            )
        out[m] = best
    return out


def summarise(prob, pred, ref, thresholds=DEFAULT_THRESHOLDS["probability"], metric: str = "probability") -> dict:
    B = prob.shape[1] - 1
    valid = ref >= 0
    right = (pred == ref) & valid
    slots = []
    for s in range(B + 1):
        v = valid[:, s]
        row = {
            "slot": s,
            "n": int(v.sum()),
            "agree_with_ar": float(right[v, s].mean()) if v.any() else None,
            "mean_confidence": float(prob[v, s].mean()) if v.any() else None,
        }
        if s:
            row["repeats_previous_slot"] = float((pred[v, s] == pred[v, s - 1]).mean()) if v.any() else None
        slots.append(row)
    table = [replay(prob, pred, ref, metric, tau) for tau in thresholds]
    return {"block_starts": int(len(prob)), "block_size": B, "metric": metric, "slots": slots, "thresholds": table}


def format_report(rep: dict) -> str:
    lines = [
        f"{rep['block_starts']} block starts, B = {rep['block_size']}",
        f"{'slot':>4} {'n':>7} {'agree':>7} {'conf':>7} {'repeats':>8}",
    ]
    for s in rep["slots"]:
        rp = s.get("repeats_previous_slot")
        lines.append(
            f"{s['slot']:>4} {s['n']:>7} {s['agree_with_ar']:>7.3f} {s['mean_confidence']:>7.3f} "
            f"{'' if rp is None else f'{rp:.3f}':>8}"
        )
    lines.append(
        f"{'tau':>6} {'tok/step':>9} {'precision':>10} {'err steps':>10}   ({rep.get('metric', 'probability')})"
    )
    for t in rep["thresholds"]:
        p = "-" if t["precision"] is None else f"{t['precision']:.4f}"
        lines.append(f"{t['threshold']:>6.2f} {t['tokens_per_step']:>9.3f} {p:>10} {t['steps_with_error']:>10.4f}")
    if "metrics" in rep:
        lines.append("most tokens/step within a share of steps with a wrong token (threshold in brackets)")
        budgets = [b["budget"] for b in next(iter(rep["metrics"].values()))]
        lines.append(f"{'metric':>12} " + " ".join(f"{f'<= {b:g}':>17}" for b in budgets))
        for m, best in rep["metrics"].items():
            cells = [
                f"{b['tokens_per_step']:.3f} ({'-' if b['threshold'] is None else format(b['threshold'], '.3g')})"
                for b in best
            ]
            lines.append(f"{m:>12} " + " ".join(f"{c:>17}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a MARS checkpoint (default: the embedded default with its weights)")
    ap.add_argument(
        "--data", required=True, help="a chat/prompt-completion .jsonl file (e.g. data/distilled/valid.jsonl)"
    )
    ap.add_argument("--limit", type=int, default=None, help="use the first N records")
    ap.add_argument("--metric", choices=METRICS, default=None, help="confidence metric (default: the checkpoint's)")
    ap.add_argument("--thresholds", default=None, help="comma-separated (default: a spread for the metric)")
    ap.add_argument(
        "--compare-metrics",
        action="store_true",
        help="also replay every metric on a fine grid: the most tokens/step within each error budget",
    )
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)

    from pathlib import Path

    from mars.evaluate import load_examples, load_model

    session = load_model(args.model, "torch")
    if session.mars is None:
        sys.exit(f"{args.model}: no mars.json; its masks were never trained")
    examples = load_examples(Path(args.data), session.loaded.tokenizer, block_size=session.block_size())[: args.limit]
    metric = args.metric or session.mars.metric
    taus = [float(x) for x in args.thresholds.split(",")] if args.thresholds else DEFAULT_THRESHOLDS[metric]
    metrics = METRICS if args.compare_metrics else (metric,)
    confs, pred, ref = slot_records(session, examples, metrics=metrics)
    rep = summarise(confs[metric], pred, ref, thresholds=taus, metric=metric)
    if args.compare_metrics:
        rep["metrics"] = compare_metrics(confs, pred, ref)
    rep["model"], rep["data"] = args.model or "default", args.data
    print(format_report(rep))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2) + "\n")
    return rep


if __name__ == "__main__":
    main()
