"""Cost-aware feeding: what a forward costs, and how wide to feed.

A lossless step feeds the token(s) not yet cached, the drafts to verify, `m` masks that
propose the next drafts, and optionally spare mask groups. Its output is AR's whatever
is fed; only the speed changes. Feeding more tokens pays when the forward's cost grows
slowly with width (a GPU, Apple silicon, packed CPU weights) and loses when it grows
fast. So the loop keeps:

- a `CostCurve`: seconds of one forward against the tokens it feeds (batch x width),
  measured once per device, dtype and model (`calibrate`, cached by the caller) and
  refreshed from the forwards the loop actually times;
- `DraftStats`: per draft source (the masks, the spare groups, n-gram lookup) and per
  draft slot j, how often slot j was reached (every draft before it kept) and kept;

and `FeedPolicy.choose` picks, per step, the masks and spare groups that maximise the
expected tokens per second of a steady state (a three-state chain: a step has mask
drafts, spare-group drafts or none), AR's own feed (no masks) included. When nothing
pays, it feeds what AR feeds, so decoding is never meaningfully slower than AR.

Threshold mode feeds only masks; `ThresholdFeed` picks how many per step, from a frozen
copy of the curves (its choice changes the text, so it must not follow timing noise).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .plan import Sampling

CALIBRATION_WIDTHS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32)
BATCH_CALIBRATION_WIDTHS = (1, 2, 3, 5, 9, 13, 17)  # per row, for a batch's curve


def non_decreasing(values: np.ndarray) -> np.ndarray:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a
    point timed too high by noise is averaged with the lower ones after it, where a running
    maximum would carry it over every wider point."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return np.array([m for m, n in blocks for _ in range(n)], dtype=np.float64)


class CostCurve:
    """Seconds of one forward as a function of the tokens it feeds (rows x width), on a
    prefilled cache. Between measured points it interpolates; past the last it extends
    the last slope; it is made non-decreasing (a wider forward never counts as cheaper:
    `non_decreasing`)."""

    def __init__(self, points: dict[int, float], *, refresh: float = 0.1):
        if not points or any(k < 1 or not s > 0 for k, s in points.items()):
            raise ValueError(f"a cost curve needs positive times at token counts >= 1, got {points}")
        self.points = {int(k): float(s) for k, s in sorted(points.items())}
        self.refresh = refresh  # weight of a newly timed forward in the running estimate
        self._arrays = None  # (token counts, non-decreasing seconds), rebuilt after `observe`

    def seconds(self, tokens: int) -> float:
        if self._arrays is None:
            ks = np.fromiter(self.points, dtype=np.float64)
            self._arrays = ks, non_decreasing(np.fromiter(self.points.values(), dtype=np.float64))
        ks, ss = self._arrays
        t = float(max(tokens, 1))
        if t <= ks[-1]:
            return float(np.interp(t, ks, ss))
        slope = (ss[-1] - ss[-2]) / (ks[-1] - ks[-2]) if len(ks) > 1 else ss[-1] / ks[-1]
        return float(ss[-1] + max(slope, 0.0) * (t - ks[-1]))

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold in a forward the loop timed (a running average per token count)."""
        if seconds <= 0 or self.refresh <= 0:
            return
        old = self.points.get(tokens)
        self.points[tokens] = seconds if old is None else (1 - self.refresh) * old + self.refresh * seconds
        if old is None:
            self.points = dict(sorted(self.points.items()))
        self._arrays = None

    def frozen(self) -> CostCurve:
        """A copy that `observe` leaves as it is."""
        return CostCurve(dict(self.points), refresh=0.0)

    def to_dict(self) -> dict:
        """`seconds` non-decreasing (the fit `seconds()` reads), `measured` as timed."""
        seconds = non_decreasing(np.fromiter(self.points.values(), dtype=np.float64))
        return {"tokens": list(self.points), "seconds": [float(s) for s in seconds], "measured": list(self.points.values())}

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
        """The curve kept at `path`; None when there is none, or when its `seconds` fall
        somewhere (a wider forward cheaper than a narrower one: measured on a busy machine,
        or edited), since a curve like that is never kept: it is measured again."""
        try:
            d = json.loads(Path(path).read_text())
            if any(b < a for a, b in zip(d["seconds"], d["seconds"][1:])):
                return None
            return cls.from_dict(d)
        except (OSError, ValueError, KeyError, TypeError):
            return None


class BatchCosts:
    """What a forward of `batch` rows of `width` fed tokens each costs, for the policy.

    A batch's forward does not cost what one row of the same number of tokens does (each
    row attends to its own cache), so with `measure` (batch size -> a CostCurve measured
    at that batch, in total fed tokens) rows are costed on the curve of their bucket: the
    smallest of `buckets` at or above the batch (the last bucket for larger ones). A
    batch of b rows then runs on the b-row curve of the bucket B >= b at width x B tokens:
    the policy only compares feeds of one batch with each other, so the shape of the curve
    is what matters. Without `measure` every batch runs on the one-row curve at
    batch x width tokens. Curves are measured when first needed."""

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
        """Measure now every curve a decode of up to `batch` rows may need (its batch shrinks
        as rows finish), so that no measurement falls inside a timed run."""
        for b in self.buckets:
            if b <= self.bucket(batch):
                self.curve(b)

    def seconds(self, batch: int, width: float) -> float:
        b = self.bucket(batch)
        rows = batch if b == 1 else b  # the one-row curve takes the batch's tokens, a bucket's its own rows
        return self.curve(batch).seconds(max(1, round(rows * width)))

    def snapshot(self) -> BatchCosts:
        """A copy of the curves measured so far that forwards timed later leave unchanged
        (curves it measures later are its own)."""
        copy = BatchCosts(self.one.frozen(), self.measure, self.buckets)
        copy.curves.update({b: c.frozen() for b, c in self.curves.items() if b != 1})
        return copy

    def observe(self, batch: int, width: int, seconds: float) -> None:
        """Fold in a forward the loop timed, where its batch is its bucket's (or no curve
        of its own was measured)."""
        b = self.bucket(batch)
        if b == 1:
            self.one.observe(batch * width, seconds)
        elif b == batch:
            self.curve(batch).observe(b * width, seconds)


def time_forwards(backend, prompt: list[int], widths, *, repeats: int = 3, filler: int = 0, batch: int = 1,
                  ar_filler: int | None = None, before=None) -> dict[int, list[float]]:
    """Seconds of one cached forward of k new tokens (per k in `widths`), one per round, on a
    cache prefilled with `prompt` (`batch` copies), cropped back after each; greedy, no metric
    (a lossless step's cost). The widths are interleaved round by round so drift hits them
    alike. The new tokens are `filler`, or `ar_filler` for k = 1: a one-token forward is an AR
    step, which feeds no mask (a gated adapter does no work there). `before(seconds)`, when
    given, hears how long the rounds should take, from a forward of the narrowest and of the
    widest width (after one to warm up), before they start."""
    greedy = Sampling()
    n = len(prompt)
    ids = np.tile(np.asarray(prompt, dtype=np.int64), (batch, 1))
    cache = backend.new_cache(batch)
    backend.step(cache, ids, np.tile(np.arange(n), (batch, 1)), None, np.full((batch, 1), n - 1), metric=None, sampling=greedy)

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
        forward(widths[0])
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


# Rounds a stored curve is measured over. With 3, on a shared 2-core machine, a batch-2 curve
# came out with its 2-token point 13% above its 4-token one, though both run the same 4-row
# product (packed.PAD_ROWS); after the non-decreasing fit a mask looked free at batch 2,
# where one mask a row made a real forward (rows of different lengths) cost 12% more.
CALIBRATION_ROUNDS = 7
# Where a width's median round is this much slower than its fastest (the median over the
# widths), the machine was busy: as many rounds again are timed before the curve is kept.
NOISY = 0.25


def noise(samples: dict[int, list[float]]) -> float:
    """How much slower a typical round was than the fastest, per width, in the median over
    the widths: 0 on a quiet machine."""
    return float(statistics.median(statistics.median(v) / min(v) - 1.0 for v in samples.values()))


def calibrate(backend, prompt: list[int], *, widths=CALIBRATION_WIDTHS, repeats: int = CALIBRATION_ROUNDS, filler: int = 0,
              ar_filler: int | None = None, batch: int = 1, before=None) -> CostCurve:
    """A cost curve for `backend` measured now (a few seconds on a small model); with
    `batch` > 1, of forwards of that many rows (the curve in total fed tokens). Load only
    ever adds time, so each width keeps its fastest round; where the rounds disagree by more
    than `NOISY` (`noise`), as many rounds again are timed first. `before`: see
    `time_forwards`."""
    samples = time_forwards(backend, prompt, widths, repeats=repeats, filler=filler, ar_filler=ar_filler, batch=batch, before=before)
    if noise(samples) > NOISY:
        more = time_forwards(backend, prompt, widths, repeats=repeats, filler=filler, ar_filler=ar_filler, batch=batch)
        samples = {k: v + more[k] for k, v in samples.items()}
    return CostCurve({batch * k: min(v) for k, v in samples.items()})


@dataclass
class DraftStats:
    """Per draft source and slot j: steps where slot j was fed and every draft before it
    was kept (`reached`), and where it was kept too. `rate(source, j)` is the estimated
    chance that slot j is kept once reached, with a prior of `prior_mean` worth
    `prior_weight` observations."""

    slots: int
    prior_mean: float = 0.5
    prior_weight: float = 2.0
    reached: dict[str, list[int]] = field(default_factory=dict)
    kept: dict[str, list[int]] = field(default_factory=dict)

    def _lists(self, source: str, width: int):
        for table in (self.reached, self.kept):
            row = table.setdefault(source, [])
            if len(row) < width:
                row.extend([0] * (width - len(row)))
        return self.reached[source], self.kept[source]

    def record(self, source: str, fed: int, kept: int) -> None:
        if fed <= 0:
            return
        reached, kept_ = self._lists(source, fed)
        for j in range(min(kept + 1, fed)):
            reached[j] += 1
        for j in range(kept):
            kept_[j] += 1

    def record_alternatives(self, fed: int, hit: int) -> None:
        """A step whose first draft failed with `fed` runners-up fed: runner-up k was AR's
        token if k == `hit` (-1: none was). Under source "runner_up", slot k counts the steps that
        fed runner-up k (`reached`) and those where it was AR's token (`kept`)."""
        reached, kept = self._lists("runner_up", fed)
        for k in range(fed):
            reached[k] += 1
        if 0 <= hit < fed:
            kept[hit] += 1

    def rate(self, source: str, j: int) -> float:
        reached, kept = self._lists(source, j + 1)
        return (kept[j] + self.prior_mean * self.prior_weight) / (reached[j] + self.prior_weight)

    def rates(self, source: str, n: int) -> list[float]:
        return [self.rate(source, j) for j in range(n)]

    def expected_kept(self, source: str, n: int) -> float:
        """Expected drafts kept out of the first n of this source."""
        return float(self.expected_kept_each(source, n)[-1]) if n else 0.0

    def expected_kept_each(self, source: str, n: int) -> np.ndarray:
        """(n,) expected drafts kept out of the first d of this source, for d = 1 .. n."""
        return np.cumsum(np.cumprod(self.rates(source, n)))


def steady_state(mask_rates: list[float], spare_rates: list[float], masks: int, groups: int,
                 batch: int = 1) -> tuple[float, float, float]:
    """A lossless step feeding `masks` masks and `groups` spare groups forever: the
    stationary mix of steps with mask drafts (M), spare-group drafts (S) and none (N).
    Returns (tokens per step and row, mean fed width per row, fraction of steps with drafts).

    A batch's forward is as wide as its widest row: with `batch` rows each drafting a
    fraction f of its steps, a step has drafts in some row with chance 1 - (1 - f)^batch,
    and then every row pays for their width (at batch 1, the chance is f).

    From a step with d = masks drafts of keep rates r, exactly g are kept with chance
    prod(r[:g]) (1 - r[g]); all kept -> M (the masks' proposals), g < groups -> S (group
    g's proposals), else N. From N the masks' proposals make the next step M."""
    if masks == 0:
        return 1.0, 1.0, 0.0

    def outcome(rates):
        reach, to_s, kept = 1.0, 0.0, 0.0  # reach: chance the first g drafts were kept
        for g in range(masks):
            if g < groups:
                to_s += reach * (1.0 - rates[g])  # exactly g kept, and group g's proposals follow
            reach *= rates[g]
            kept += reach
        return kept, reach, to_s, 1.0 - reach - to_s

    km, mm, ms, mn = outcome(mask_rates)
    ks, sm, ss, sn = outcome(spare_rates)
    # Stationary distribution of the chain over (M, S, N), in closed form: N always leads to
    # M, so pi_S = pi_M ms / (1 - ss) and pi_N = pi_M mn + pi_S sn (1 - ss > 0: every keep
    # rate is below 1, DraftStats' prior sees to that).
    s_per_m = ms / max(1.0 - ss, 1e-12)
    n_per_m = mn + s_per_m * sn
    pi_m = 1.0 / (1.0 + s_per_m + n_per_m)
    pi_s, pi_n = s_per_m * pi_m, n_per_m * pi_m
    tokens = pi_m * (1 + km) + pi_s * (1 + ks) + pi_n
    drafting = pi_m + pi_s
    narrow, wide = 1 + masks, 1 + masks + masks + groups * masks
    width = narrow + (wide - narrow) * (1.0 - (1.0 - drafting) ** batch)
    return float(tokens), float(width), drafting


class FeedPolicy:
    """Per step, the masks and spare groups a lossless window step feeds (see the module
    docstring); `max_masks` is the checkpoint's block size B, `max_groups` the spare-group
    cap. Keep one policy per loaded model to carry what it learned across calls.

    AR's feed teaches nothing about the masks, so after `explore` AR steps in a row the
    policy feeds the best other choice for two steps (one proposes drafts, the next
    verifies them): estimates that went too low can recover. Each probe that leaves AR the
    best choice doubles the run before the next (up to 32x `explore`), so a device where
    the masks never pay (a CPU at batch 8) spends ever fewer steps on probes; a choice
    other than AR's restores `explore`."""

    source = "masks"  # the draft source whose keep rates `block_tokens` reads

    def __init__(self, curve: CostCurve | BatchCosts, max_masks: int, max_groups: int, *, stats: DraftStats | None = None,
                 explore: int = 32):
        self.costs = curve if isinstance(curve, BatchCosts) else BatchCosts(curve)
        self.max_masks = max_masks
        self.max_groups = max_groups
        self.stats = stats or DraftStats(slots=max_masks)
        self.explore = explore
        self.choices: dict[tuple[int, int], int] = {}  # (masks, groups) -> steps that fed it
        # [used, offered]: a row's drafts from the masks (their own, a spare group's, an
        # alternative group's) on offer at a step, and taken over lookup's and the corpus's.
        self.mask_use = [0, 0]
        self._ar_run = 0
        self._probe = 0
        self._interval = explore  # AR steps in a row before the next probe

    @classmethod
    def for_plan(cls, curve: CostCurve | BatchCosts, plan) -> FeedPolicy:
        """The policy of a plan's (mars.core.decode.plan.DecodeSettings) lossless loop: its block
        size, and the spare groups it may feed on the window cache (where the block cache
        gives way to the window's too). Every caller builds its policy here."""
        return cls(curve, plan.block_size, plan.window_spare_groups)

    @property
    def curve(self) -> CostCurve:
        """The one-row cost curve."""
        return self.costs.one

    def candidates(self):
        yield 0, 0
        for m in range(1, self.max_masks + 1):
            for g in range(0, min(m, self.max_groups) + 1):
                yield m, g

    def used(self) -> float:
        """How often the masks' drafts were taken where they were on offer (prior 1/2): n-gram
        and corpus drafts, where a row has them, usually displace them."""
        used, offered = self.mask_use
        return (used + 1.0) / (offered + 2.0)

    def rate(self, masks: int, groups: int, batch: int = 1) -> float:
        """Expected tokens per second (per row) of feeding this forever (`steady_state`, whose
        width is the batch's widest row's), the masks' drafts counted where they are taken
        (`used`)."""
        s = self.stats
        tokens, width, _ = steady_state(s.rates("masks", masks), s.rates("spare", masks), masks, groups, batch)
        return (1.0 + self.used() * (tokens - 1.0)) / self.costs.seconds(batch, width)

    def choose(self, batch: int = 1) -> tuple[int, int]:
        ranked = sorted(self.candidates(), key=lambda c: (self.rate(*c, batch=batch), -c[0], -c[1]), reverse=True)
        best = ranked[0]
        if best == (0, 0) and self.max_masks:
            if not self._probe:
                self._ar_run += 1
                if self._ar_run > self._interval:
                    self._ar_run, self._probe = 0, 2
                    # If AR is still the best after this probe, the next one waits twice as long.
                    self._interval = min(2 * self._interval, 32 * self.explore)
            if self._probe:
                self._probe -= 1
                best = ranked[1]
        else:
            self._ar_run = 0
            self._interval = self.explore
        self.choices[best] = self.choices.get(best, 0) + 1
        return best

    def fits(self, max_masks: int, max_groups: int) -> bool:
        return (self.max_masks, self.max_groups) == (max_masks, max_groups)

    def block_tokens(self, slots: int) -> float:
        """Expected tokens of a block-cache step whose masks may give `slots` more tokens:
        one AR token plus the expected run of kept ones."""
        return 1.0 + self.stats.expected_kept(self.source, slots)


class ThresholdFeed(FeedPolicy):
    """Per step, how many of the B masks a threshold-mode step feeds (docs/method.md §9).

    A threshold step feeding m masks takes the AR token plus the run of leading masks whose
    confidence passes the threshold, at most m; nothing carries over to the next step. So
    feeding m forever gives 1 + sum_j P(run >= j) tokens a step (per-slot pass rates in
    `stats`, source "threshold", with the weak prior) for a forward as wide as the widest
    row: its uncached tokens (1 + the run it took last step) plus m masks. The policy feeds
    the m with the most expected tokens per second, m = 0 being AR's own feed, and probes
    as FeedPolicy does.

    Unlike lossless mode, what a threshold step feeds changes the text (a mask not fed
    cannot be accepted), so the choice must not depend on when it is made: the policy
    decides on a `BatchCosts.snapshot` of the curves (the forwards of the run do not
    refresh them) and on the statistics of the call it serves (one policy per call). The
    text then depends on the prompt, the batch and the device's cost curve, not on timing
    noise within the run, nor on earlier calls."""

    source = "threshold"

    def __init__(self, curve: CostCurve | BatchCosts | FeedPolicy, max_masks: int, *, explore: int = 32):
        super().__init__(frozen_costs(curve), max_masks, 0, explore=explore)

    def candidates(self):
        for m in range(self.max_masks + 1):
            yield m, 0

    def rate(self, masks: int, groups: int = 0, batch: int = 1) -> float:
        reach = np.cumprod(self.stats.rates(self.source, masks))  # P(run >= j), j = 1..masks
        tokens = 1.0 + float(reach.sum())
        # The widest of `batch` rows feeds 1 + its last run (expected max over the rows) + m.
        widest_run = float(np.sum(1.0 - (1.0 - reach) ** batch))
        return tokens / self.costs.seconds(batch, 1 + masks + widest_run)

    def record(self, fed: int, taken: int) -> None:
        """A row's step: `fed` masks it could take (its limit less the AR token), `taken`
        of them taken."""
        self.stats.record(self.source, fed, taken)


def frozen_costs(cost: CostCurve | BatchCosts | FeedPolicy) -> BatchCosts:
    """A `BatchCosts.snapshot` of the curves behind `cost` (a policy's, a batch's or one
    curve): what a feed that changes the text decides on, so that the run's own timings do
    not steer it."""
    costs = cost.costs if isinstance(cost, FeedPolicy) else cost
    return (costs if isinstance(costs, BatchCosts) else BatchCosts(costs)).snapshot()


def block_cache_pays(cost: CostCurve | BatchCosts | FeedPolicy, block_size: int, block_cache: int, spare_groups: int, batch: int) -> bool:
    """Whether decoding `batch` rows with the block cache is expected to be faster than with
    the window cache and the cost-aware feed (which falls back to AR's own feed when nothing
    pays): greedy lossless decoding with a FeedPolicy (or a curve), threshold mode with a
    ThresholdFeed.

    A block step feeds every row's B_cache slots, and once per block the finished block in
    front of them: about B_cache + t tokens a row for t tokens taken, where t is one AR
    token plus the drafts kept (the masks passed) out of min(B, B_cache - 1). The window's
    best feed is the policy's own choice. Where a forward's cost grows slowly with width (a
    GPU) the block cache can win; where it grows fast (a CPU) it cannot."""
    policy = cost if isinstance(cost, FeedPolicy) else FeedPolicy(cost, block_size, spare_groups)
    tokens = policy.block_tokens(min(block_size, block_cache - 1))
    block = tokens / policy.costs.seconds(batch, block_cache + tokens)
    window = max(policy.rate(m, g, batch=batch) for m, g in policy.candidates())
    return block >= window

