"""Confidence metrics, left-to-right prefix acceptance (docs/method.md §5) and the
speculative-sampling rule lossless sampling verifies drafts by (§8), which both backends run
on their device through `DeviceOps`.

Backends compute confidences on the device and hand back small (batch, slots)
arrays; the numpy versions here are the reference they are tested against.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

METRICS = ("probability", "entropy", "margin")
# The thresholds that mean something for each metric, ends included: a probability or a margin
# lies in [0, 1]; an entropy (in nats) is >= 0. AR mode is the strict end (1.0, or 0.0 for entropy).
THRESHOLD_RANGES = {"probability": (0.0, 1.0), "margin": (0.0, 1.0), "entropy": (0.0, math.inf)}


class ThresholdError(ValueError):
    """A threshold outside its metric's range; the message is one line naming the value and the range."""


def check_metric(metric: str) -> str:
    if metric not in METRICS:
        raise ValueError(f"unknown confidence metric {metric!r}; choose one of {', '.join(METRICS)}")
    return metric


def threshold_range_text(metric: str) -> str:
    low, high = THRESHOLD_RANGES[check_metric(metric)]
    ar = "0" if metric == "entropy" else "1.0"
    span = f"a number >= {low:g}" if math.isinf(high) else f"a number from {low:g} to {high:g}"
    return f"{span} ({ar} is plain greedy AR)"


def check_threshold(metric: str, threshold, name: str = "threshold") -> float:
    """The one range check for a threshold: a finite number within its metric's range
    (THRESHOLD_RANGES); returns it as a float, else raises ThresholdError."""
    check_metric(metric)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.integer, np.floating)):
        raise ThresholdError(f"{name} must be a number, got {threshold!r}")
    value = float(threshold)
    low, high = THRESHOLD_RANGES[metric]
    if not (math.isfinite(value) and low <= value <= high):
        raise ThresholdError(
            f"{name} {threshold!r} is out of range for the {metric} metric: use {threshold_range_text(metric)}"
        )
    return value


def ar_threshold(metric: str) -> float:
    """The threshold that is plain greedy AR for the metric: the strict end of its range."""
    return 0.0 if check_metric(metric) == "entropy" else 1.0


def is_ar_mode(metric: str, threshold: float) -> bool:
    """AR mode is decided by rule, not by comparison: a float32 softmax can round to 1.0."""
    check_metric(metric)
    return threshold <= 0.0 if metric == "entropy" else threshold >= 1.0


def loosen(metric: str, threshold: float, amount: float) -> float:
    """Move the threshold `amount` in the direction that accepts more tokens."""
    return threshold + amount if check_metric(metric) == "entropy" else threshold - amount


def looser(metric: str, a: float, b: float) -> float:
    """The looser of two thresholds: the one that accepts more tokens."""
    return max(a, b) if check_metric(metric) == "entropy" else min(a, b)


def strict_and_loose(metric: str, low: float, high: float) -> tuple[float, float]:
    """The ends of the threshold range [low, high] as (strict end, loose end)."""
    return (low, high) if check_metric(metric) == "entropy" else (high, low)


def passes(confidence: np.ndarray, metric: str, threshold: float) -> np.ndarray:
    if check_metric(metric) == "entropy":
        return confidence <= threshold
    return confidence >= threshold


def confidence_from_logits(logits: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Reference: (greedy ids, confidence) from logits (..., vocab)."""
    check_metric(metric)
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    ids = probs.argmax(axis=-1)
    if metric == "probability":
        conf = np.take_along_axis(probs, ids[..., None], axis=-1)[..., 0]
    elif metric == "margin":
        top2 = np.sort(probs, axis=-1)[..., -2:]
        conf = top2[..., 1] - top2[..., 0]
    else:
        conf = -(probs * np.log(np.clip(probs, 1e-300, None))).sum(axis=-1)
    return ids, conf


def accept_counts(confidence: np.ndarray, metric: str, threshold, limits) -> np.ndarray:
    """How many leading slots each row accepts: (batch,) from confidences (batch, slots).

    Slot 0 (the AR prediction) is always accepted; slot j > 0 while every slot
    before it was accepted and its own confidence passes. `limits[r]` caps row r
    (max_accept: B + 1, room left in a block, tokens left before max_tokens);
    a limit of 0 means the row takes nothing this step.

    `threshold` is one number for every row, or one per row (batch,): rows of a served
    batch each decode at their own threshold, AR mode decided per row by the same rule.
    """
    confidence = np.asarray(confidence)
    limits = np.asarray(limits, dtype=np.int64)
    if np.ndim(threshold) == 0:
        if is_ar_mode(metric, threshold):
            return np.minimum(limits, 1)
        ok = passes(confidence, metric, threshold)
    else:
        threshold = np.asarray(threshold, dtype=np.float64)
        ar = ar_mode_rows(metric, threshold)
        if ar.all():  # every row in AR mode (threshold 1.0): slot 0 alone, no confidence judged
            return np.minimum(limits, 1)
        ok = passes(confidence, metric, threshold[:, None])
        ok[ar, 1:] = False
    ok[:, 0] = True
    run = np.cumprod(ok, axis=1).sum(axis=1)
    return np.minimum(run, limits)


def ar_mode_rows(metric: str, thresholds: np.ndarray) -> np.ndarray:
    """`is_ar_mode` for a (batch,) array of thresholds."""
    check_metric(metric)
    thresholds = np.asarray(thresholds, dtype=np.float64)
    return thresholds <= 0.0 if metric == "entropy" else thresholds >= 1.0


class DeviceOps(Protocol):
    """The few array operations `speculative_sampling` needs, on a backend's device (torch
    tensors, MLX arrays): each backend implements them in a handful of lines."""

    def arange(self, n: int): ...

    def zeros_int(self, n: int): ...

    def zeros_like(self, x): ...

    def take(self, x, ids):
        """x (b, k, V), ids (b, k): x[r, j, ids[r, j]]."""
        ...

    def leading(self, ok):
        """(b, k) bool -> (b,): the length of each row's run of leading True."""
        ...

    def where(self, condition, a, b): ...

    def minimum(self, x, n: int): ...

    def at_least(self, x, low: float): ...

    def row_sum(self, x):
        """(b, V) -> (b, 1)."""
        ...


def speculative_sampling(ops: DeviceOps, p, q, drafts, n_drafts, u):
    """The speculative-sampling rule (docs/method.md §8), on the device, for a step that fed
    each row's drafts: `p` (b, D + 1, V) the model's sampling distributions before each of the
    D draft slots and after the last, `q` (b, D, V) the distributions the drafts were drawn
    from, `drafts` (b, D) their ids, of which row r fed `n_drafts[r]`, `u` (b, D) uniform
    draws. Draft j is kept with probability min(1, p(x) / q(x)) while every draft before it
    was. Returns (kept (b,), the distribution (b, V) the step's token is drawn from:
    norm(max(0, p - q)) at the first rejection, p after the last draft), so that the output
    is distributed as AR sampling's."""
    batch, width = drafts.shape
    rows = ops.arange(batch)
    kept = ops.zeros_int(batch)
    q_at = ops.zeros_like(p[:, 0])
    if width:
        px = ops.take(p[:, :width], drafts)
        qx = ops.take(q, drafts)
        # q(x) > 0 since x was drawn from q
        ok = (u * qx < px) & (ops.arange(width)[None, :] < n_drafts[:, None])
        kept = ops.leading(ok)
        rejected = kept < n_drafts
        q_at = ops.where(rejected[:, None], q[rows, ops.minimum(kept, width - 1)], q_at)
    p_at = p[rows, kept]
    residual = ops.at_least(p_at - q_at, 0.0)
    total = ops.row_sum(residual)
    return kept, ops.where(total > 0, residual / ops.at_least(total, 1e-30), p_at)


def tree_sampling(ops: DeviceOps, dist, kept, nodes, anchors, live, u):
    """The speculative rule over a token tree's nodes (docs/method.md §8), after `speculative_sampling`:
    `dist` (b, V) the distribution the step's token is drawn from, norm(max(0, p - q)) where the chain
    was rejected at slot `kept` (b,); `nodes`, `anchors` (b, K) each node's id and the drafts before it
    (where `live` (b, K) bool), nodes of a row in the order they are tried; `u` (b, K) uniform draws.
    Each node anchored at `kept` is a fixed candidate: taken with its probability under `dist`, else
    removed from `dist` (the rest renormalised) before the next is tried, so the token stays distributed
    as `dist`. Returns (the node taken (b,), -1 for none; the distribution left to draw from, (b, V))."""
    batch, k = nodes.shape
    chosen = ops.zeros_int(batch) - 1
    vocab = ops.arange(dist.shape[-1])[None, :]
    for j in range(k):
        node = nodes[:, j]
        tried = live[:, j] & (anchors[:, j] == kept) & (chosen < 0)
        prob = ops.take(dist[:, None], node[:, None])[:, 0]
        taken = tried & (u[:, j] < prob)
        chosen = ops.where(taken, j, chosen)
        rest = ops.where(vocab == node[:, None], 0.0, dist)
        rest = rest / ops.at_least(ops.row_sum(rest), 1e-30)
        dist = ops.where((tried & ~taken)[:, None], rest, dist)
    return chosen, dist
