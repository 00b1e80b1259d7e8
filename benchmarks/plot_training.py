"""Plot the losses of a `mars finetune` run from its training_log.jsonl (PNG, matplotlib Agg).

    python benchmarks/plot_training.py RUN_DIR/training_log.jsonl OUT.png
"""

import json
import sys


def main(log_path: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(log_path) if line.strip()]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(steps, [r["noisy"] for r in rows], label="noisy (masks), train", alpha=0.6)
    ax.plot(steps, [r["clean"] for r in rows], label="clean (AR), train", alpha=0.6)
    val = [r for r in rows if "val_noisy" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_noisy"] for r in val], "o-", label="noisy, valid")
        ax.plot([r["step"] for r in val], [r["val_clean"] for r in val], "s-", label="clean, valid")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token, per-row mean)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
