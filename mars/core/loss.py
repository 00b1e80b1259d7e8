"""Logit alignment for the MARS loss (docs/method.md §4), as index arrays the backends gather with.

The output at sequence index i predicts the label at logical position p(i) + 1, in
both streams. For target position t (1 <= t < L, labelled), the clean prediction is
the output at L + t - 1 and the noisy prediction the output at t - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE = -100


@dataclass
class Alignment:
    rows: np.ndarray  # (T,) batch row of each target
    noisy_index: np.ndarray  # (T,) output index in the joined sequence predicting it from the noisy stream
    clean_index: np.ndarray  # (T,) output index predicting it from the clean stream
    targets: np.ndarray  # (T,) token ids
    weights: np.ndarray  # (T,) float32, sum to 1: the loss is sum(weights * per-token loss)

    @property
    def count(self) -> int:
        return int(self.targets.size)


def align(labels, normalize: str = "row", start: int = 0) -> Alignment:
    """Targets of a padded batch of labels (b, L); `start`: where the noisy stream begins
    (see masks.noisy_start), so the noisy stream has L - start entries and the clean one follows.

    normalize="row": mean over each row's labelled tokens, then mean over rows (the
    reference's default). normalize="token": one mean over every labelled token of the batch.
    """
    labels = np.asarray(labels, dtype=np.int64)
    length = labels.shape[1]
    usable = labels != IGNORE
    usable[:, 0] = False  # position 0 has no predecessor in its stream
    rows, t = np.nonzero(usable)
    if rows.size == 0:
        raise ValueError("batch has no labelled token")
    if normalize == "row":
        per_row = usable.sum(axis=1)
        weights = 1.0 / (per_row[rows] * np.count_nonzero(per_row))
    elif normalize == "token":
        weights = np.full(rows.size, 1.0 / rows.size)
    else:
        raise ValueError(f"normalize must be 'row' or 'token', got {normalize!r}")
    return Alignment(
        rows=rows,
        noisy_index=t - 1 - start,
        clean_index=length - start + t - 1,
        targets=labels[rows, t],
        weights=weights.astype(np.float32),
    )
