"""What a forward costs on a device (docs/method.md §9), the curve the feed (mars.core.decode.feed)
decides on: feeding more tokens pays only where a forward's cost grows slowly with its width.
Measured once (`calibrate`, kept by the caller), refreshed from the forwards the loop times."""

from __future__ import annotations

import bisect
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from .plan import Sampling

CALIBRATION_WIDTHS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32)
BATCH_CALIBRATION_WIDTHS = (1, 2, 3, 5, 9, 13, 17)  # per row, for a batch's curve
# A first run's curve: a short probe (the widths a feed mostly chooses between, few rounds), so that
# a newcomer's first reply does not wait on the thorough measurement (--remeasure-cost runs that); the
# decoding loop refines the curve from the forwards it times (`observe`).
PROBE_WIDTHS = (1, 2, 4, 8, 16, 32)
BATCH_PROBE_WIDTHS = (1, 2, 4, 8)
PROBE_ROUNDS = 2


def non_decreasing(values) -> np.ndarray:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): unlike a
    running maximum, one point timed high by noise does not raise every wider point."""
    return np.array(_pooled(values), dtype=np.float64)


def _pooled(values) -> list[float]:
    """`non_decreasing` as a list of floats."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def interpolated(x: float, xs: list[float], ys: list[float]) -> float:
    """np.interp(x, xs, ys) for one x within [xs[0], xs[-1]], to the bit, in plain Python: a loop
    step asks a few of these, and one array call costs more than the arithmetic."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    j = bisect.bisect_right(xs, x) - 1  # xs[j] <= x < xs[j + 1]
    if x == xs[j]:
        return ys[j]
    slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
    return slope * (x - xs[j]) + ys[j]


class CostCurve:
    """Seconds of one forward against the tokens it feeds (rows x width), on a prefilled cache:
    interpolated, the last slope extended, made non-decreasing (never cheaper for being wider)."""

    def __init__(self, points: dict[int, float], *, refresh: float = 0.1):
        if not points or any(k < 1 or not s > 0 for k, s in points.items()):
            raise ValueError(f"a cost curve needs positive times at token counts >= 1, got {points}")
        self.points = {int(k): float(s) for k, s in sorted(points.items())}
        self.refresh = refresh  # weight of a newly timed forward in the running estimate
        self._arrays = None  # (token counts, non-decreasing seconds, seconds asked), kept up to date by `observe`

    def seconds(self, tokens: int) -> float:
        if self._arrays is None:
            self._arrays = [float(k) for k in self.points], _pooled(self.points.values()), {}
        ks, ss, known = self._arrays  # known: what was asked since the curve last changed
        t = float(max(tokens, 1))
        found = known.get(t)
        if found is None:
            if t <= ks[-1]:
                found = interpolated(t, ks, ss)
            else:
                slope = (ss[-1] - ss[-2]) / (ks[-1] - ks[-2]) if len(ks) > 1 else ss[-1] / ks[-1]
                found = ss[-1] + max(slope, 0.0) * (t - ks[-1])
            known[t] = found
        return found

    def seconds_of(self, tokens: list[int]) -> list[float]:
        """`seconds` of each of `tokens`, in one call (a step's feed asks a dozen)."""
        if self._arrays is None:
            self.seconds(1)  # the fit, made once
        known, out = self._arrays[2], []
        for k in tokens:
            found = known.get(float(max(k, 1)))
            out.append(found if found is not None else self.seconds(k))
        return out

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold in a forward the loop timed (a running average per token count)."""
        if seconds <= 0 or self.refresh <= 0:
            return
        old = self.points.get(tokens)
        self.points[tokens] = seconds if old is None else (1 - self.refresh) * old + self.refresh * seconds
        if old is None or self._arrays is None:  # a new point: every segment may move
            self.points = dict(sorted(self.points.items()))
            self._arrays = None
            return
        # A point that moved changes the fit near it alone (most steps): what was asked outside the
        # segments whose ends moved keeps its answer, the same float `seconds` would compute again.
        ks, ss, known = self._arrays
        fit = _pooled(self.points.values())
        moved = [i for i, (a, b) in enumerate(zip(ss, fit)) if a != b]
        if moved:
            lo = ks[moved[0] - 1] if moved[0] > 0 else -math.inf
            # Past the last point the last two points' slope extends the curve.
            hi = ks[moved[-1] + 1] if moved[-1] < len(ks) - 2 else math.inf
            known = {t: v for t, v in known.items() if not lo < t < hi}
        self._arrays = ks, fit, known

    def frozen(self) -> CostCurve:
        """A copy that `observe` leaves as it is."""
        return CostCurve(dict(self.points), refresh=0.0)

    def to_dict(self) -> dict:
        """`seconds` non-decreasing (the fit `seconds()` reads), `measured` as timed."""
        seconds = non_decreasing(np.fromiter(self.points.values(), dtype=np.float64))
        return {
            "tokens": list(self.points),
            "seconds": [float(s) for s in seconds],
            "measured": list(self.points.values()),
        }

    @classmethod
    def from_dict(cls, d: dict) -> CostCurve:
        return cls(dict(zip(d["tokens"], d["seconds"])))

    def save(self, path: Path, **meta) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**meta, **self.to_dict()}, indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> CostCurve | None:
        """The curve kept at `path`, or None when there is none or its `seconds` ever fall (measured
        on a busy machine, or edited): such a curve is measured again."""
        try:
            d = json.loads(Path(path).read_text())
            if any(b < a for a, b in zip(d["seconds"], d["seconds"][1:])):
                return None
            return cls.from_dict(d)
        except (OSError, ValueError, KeyError, TypeError):
            return None


class BatchCosts:
    """What a forward of `batch` rows of `width` fed tokens each costs. A row attends to its own cache,
    so with `measure` (batch size -> a CostCurve at that batch, in total fed tokens) b rows are costed
    on the curve of the smallest bucket B >= b (the last for larger batches) at width x B tokens (the
    feed compares feeds of one batch only); without it, the one-row curve at batch x width tokens."""

    def __init__(self, one: CostCurve, measure=None, buckets=(1, 2, 4, 8)):
        self.one = one
        self.measure = measure
        self.buckets = tuple(sorted(set(buckets) | {1}))
        self.curves: dict[int, CostCurve] = {1: one}

    def bucket(self, batch: int) -> int:
        if self.measure is None:
            return 1
        return next((b for b in self.buckets if b >= batch), self.buckets[-1])

    def curve(self, batch: int) -> CostCurve:
        b = self.bucket(batch)
        if b not in self.curves:
            self.curves[b] = self.measure(b)
        return self.curves[b]

    def prepare(self, batch: int) -> None:
        """Measure now every curve a decode of up to `batch` rows may need, so none falls in a timed run."""
        for b in self.buckets:
            if b <= self.bucket(batch):
                self.curve(b)

    def seconds(self, batch: int, width: float) -> float:
        if batch == 1:  # every bucket list starts at 1: the one-row curve
            return self.one.seconds(max(1, round(width)))
        b = self.bucket(batch)
        rows = batch if b == 1 else b  # the one-row curve takes the batch's tokens, a bucket's its own rows
        return self.curve(batch).seconds(max(1, round(rows * width)))

    def seconds_of(self, batch: int, widths: list[float]) -> list[float]:
        """`seconds(batch, w)` of each of `widths`, in one call."""
        if batch == 1:
            return self.one.seconds_of([max(1, round(w)) for w in widths])
        b = self.bucket(batch)
        rows = batch if b == 1 else b
        return self.curve(batch).seconds_of([max(1, round(rows * w)) for w in widths])

    def snapshot(self) -> BatchCosts:
        """A copy of the curves so far that later timed forwards leave unchanged."""
        copy = BatchCosts(self.one.frozen(), self.measure, self.buckets)
        copy.curves.update({b: c.frozen() for b, c in self.curves.items() if b != 1})
        return copy

    def observe(self, batch: int, width: int, seconds: float) -> None:
        """Fold in a timed forward where its batch is its bucket's (or all share the one-row curve)."""
        b = self.bucket(batch)
        if b == 1:
            self.one.observe(batch * width, seconds)
        elif b == batch:
            self.curve(batch).observe(b * width, seconds)


def time_forwards(
    backend,
    prompt: list[int],
    widths,
    *,
    repeats: int = 3,
    filler: int = 0,
    batch: int = 1,
    ar_filler: int | None = None,
    before=None,
) -> dict[int, list[float]]:
    """Seconds of one forward of k new tokens, per k in `widths`, one per round after a warm-up, on a
    cache prefilled with `prompt` (`batch` copies), widths interleaved so drift hits them alike. A
    one-token forward feeds `ar_filler`, as an AR step feeds no mask (a gated adapter does no work
    there). `before(seconds)` hears beforehand about how long the rounds will take."""
    greedy = Sampling()
    n = len(prompt)
    ids = np.tile(np.asarray(prompt, dtype=np.int64), (batch, 1))
    cache = backend.new_cache(batch)
    backend.step(
        cache, ids, np.tile(np.arange(n), (batch, 1)), None, np.full((batch, 1), n - 1), metric=None, sampling=greedy
    )

    def forward(k: int) -> float:
        new = np.full((batch, k), filler if k > 1 or ar_filler is None else ar_filler, dtype=np.int64)
        pos = np.tile(n + np.arange(k), (batch, 1))
        read = np.tile(np.arange(k), (batch, 1))
        t0 = time.perf_counter()
        backend.step(cache, new, pos, None, read, metric=None, sampling=greedy)
        seconds = time.perf_counter() - t0
        backend.crop(cache, n)
        return seconds

    if before is not None:  # a forward's cost taken as linear in its width, between the two ends, once warm
        # Both ends warmed first: a first forward of a shape may pay for more than the forward (a
        # compiled graph, a new kernel), and an estimate made from it said thousands of seconds.
        forward(widths[0])
        forward(widths[-1])
        narrow, wide = forward(widths[0]), forward(widths[-1])
        span = max(widths[-1] - widths[0], 1)
        before((repeats + 1) * sum(narrow + (wide - narrow) * (k - widths[0]) / span for k in widths))
    samples: dict[int, list[float]] = {k: [] for k in widths}
    for rep in range(repeats + 1):  # the first round warms up
        for k in widths:
            seconds = forward(k)
            if rep:
                samples[k].append(seconds)
    return samples


# Rounds a stored curve is measured over (benchmarks/README.md, "Cost curves: how the calibration changed").
CALIBRATION_ROUNDS = 7
# Rounds slower than the fastest by this much (`noise`) mean a busy machine: `calibrate` times more.
NOISY = 0.25


def noise(samples: dict[int, list[float]]) -> float:
    """The median over the widths of how much slower a typical round was than the fastest: 0 if quiet."""
    return float(statistics.median(statistics.median(v) / min(v) - 1.0 for v in samples.values()))


def calibrate(
    backend,
    prompt: list[int],
    *,
    widths=CALIBRATION_WIDTHS,
    repeats: int = CALIBRATION_ROUNDS,
    filler: int = 0,
    ar_filler: int | None = None,
    batch: int = 1,
    before=None,
) -> CostCurve:
    """A cost curve for `backend` measured now; with `batch` > 1, of forwards of that many rows (in
    total fed tokens). Load only adds time, so each width keeps its fastest round; where the rounds
    disagree by more than `NOISY`, as many again are timed first."""
    samples = time_forwards(
        backend, prompt, widths, repeats=repeats, filler=filler, ar_filler=ar_filler, batch=batch, before=before
    )
    if noise(samples) > NOISY:
        more = time_forwards(backend, prompt, widths, repeats=repeats, filler=filler, ar_filler=ar_filler, batch=batch)
        samples = {k: v + more[k] for k, v in samples.items()}
    return CostCurve({batch * k: min(v) for k, v in samples.items()})
