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
    slots: np.ndarray | None = None  # (T,) the noisy prediction's window slot (see `slots`); with block_size
    noisy_weights: np.ndarray | None = None  # (T,) the noisy stream's weights when slot weights apply

    def __post_init__(self):
        if self.noisy_weights is None:
            self.noisy_weights = self.weights

    @property
    def count(self) -> int:
        return int(self.targets.size)


def slots(labels, block_size: int, ignore: int = IGNORE) -> np.ndarray:
    """(b, L): the window slot of the noisy stream's prediction made at each position, i.e. how
    many masks the query at position i has fed in its block, itself included (the noisy
    stream masks every labelled position). The output at i predicts the token at i + 1; in a
    response block the query at in-block offset o is mask o + 1 and predicts slot o + 1 of a
    decoding window (docs/method.md §5); 0 where the query is a real token."""
    labels = np.asarray(labels)
    b, length = labels.shape
    if length % block_size:
        raise ValueError(f"padded length {length} is not a multiple of block size {block_size}")
    masked = (labels != ignore).astype(np.int64).reshape(b, length // block_size, block_size)
    return np.cumsum(masked, axis=2).reshape(b, length)


def check_slot_weights(slot_weights, block_size: int) -> tuple[float, ...]:
    """Per-slot weights of the noisy loss (slots 1..B), as floats; () keeps every slot at 1."""
    weights = tuple(float(w) for w in slot_weights)
    if not weights:
        return ()
    if len(weights) != block_size:
        raise ValueError(f"needs one weight per mask slot: {block_size} (the block size), got {len(weights)}")
    if any(not np.isfinite(w) or w < 0 for w in weights) or not any(weights):
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {list(weights)}")
    return weights


def align(labels, normalize: str = "row", start: int = 0, block_size: int | None = None, slot_weights=()) -> Alignment:
    """Targets of a padded batch of labels (b, L); `start`: where the noisy stream begins
    (see masks.noisy_start), so the noisy stream has L - start entries and the clean one follows.

    normalize="row": mean over each row's labelled tokens, then mean over rows (the
    reference's default). normalize="token": one mean over every labelled token of the batch.

    `slot_weights` (w_1..w_B, needs `block_size`) weigh the noisy stream's targets by the slot
    that predicts them (`slots`; a target predicted from a real token keeps 1), each row's noisy
    weights then rescaled to the row's total: slots trade weight within a row, and the noisy
    loss keeps its scale. The clean stream keeps `weights`.
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
    weights = weights.astype(np.float32)
    slot = noisy_weights = None
    if block_size is not None:
        slot = slots(labels, block_size)[rows, t - 1]
    if len(slot_weights) and block_size is None:
        raise ValueError("slot weights need the block size")
    by_slot = check_slot_weights(slot_weights, block_size or 0)
    if by_slot:
        scale = np.concatenate([[1.0], by_slot])[slot]
        scaled = weights * scale
        row_total = np.bincount(rows, weights, minlength=labels.shape[0])
        scaled_total = np.bincount(rows, scaled, minlength=labels.shape[0])
        # a row whose slots all weigh 0 keeps its weights: it has nothing else to learn from
        factor = np.divide(row_total, scaled_total, out=np.zeros_like(row_total), where=scaled_total > 0)
        noisy_weights = np.where(scaled_total[rows] > 0, scaled * factor[rows], weights).astype(np.float32)
    return Alignment(
        rows=rows,
        noisy_index=t - 1 - start,
        clean_index=length - start + t - 1,
        targets=labels[rows, t],
        weights=weights,
        slots=slot,
        noisy_weights=noisy_weights,
    )
