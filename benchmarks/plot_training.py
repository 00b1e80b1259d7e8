"""Plot the losses of a `mars finetune` run from its training_log.jsonl (PNG, matplotlib Agg).

    python benchmarks/plot_training.py RUN_DIR/training_log.jsonl [MORE_LOGS ...] OUT.png

Several logs are the stages of one run (a later one started with --init-adapter from the one
before): they are drawn one after the other, steps counted on, a line at each boundary.
"""

import json
import sys


def read_stages(paths) -> tuple[list[dict], list[int]]:
    """The rows of all logs with steps counted on across them, and the step where each later one starts."""
    rows, bounds, offset = [], [], 0
    for i, path in enumerate(paths):
        stage = [json.loads(line) for line in open(path) if line.strip()]
        if i:
            bounds.append(offset)
        rows += [{**r, "step": r["step"] + offset} for r in stage]
        offset += max((r["step"] for r in stage), default=0)
    return rows, bounds


def main(*args: str) -> None:
    *logs, out = args
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, bounds = read_stages(logs)
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(steps, [r["noisy"] for r in rows], label="noisy (masks), train", alpha=0.6)
    ax.plot(steps, [r["clean"] for r in rows], label="clean (AR), train", alpha=0.6)
    val = [r for r in rows if "val_noisy" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_noisy"] for r in val], "o-", label="noisy, valid")
        ax.plot([r["step"] for r in val], [r["val_clean"] for r in val], "s-", label="clean, valid")
    for b in bounds:
        ax.axvline(b, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("optimizer step" + (" (dotted: next stage, --init-adapter)" if bounds else ""))
    ax.set_ylabel("cross-entropy (nats/token, per-row mean)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
