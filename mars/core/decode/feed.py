"""The feed (docs/method.md §9): how wide each step is, from what a forward costs (mars.core.decode.cost)
and what the drafts keep, and `FeedController`, which keeps it between calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .cost import BatchCosts, CostCurve
from .drafts import MASKS, SPARE
from .plan import Mode, Plan


@dataclass
class DraftStats:
    """Per draft source and slot j: steps where slot j was fed and every draft before it kept
    (`reached`), and where it was kept too. `rate(source, j)`: the chance slot j is kept once
    reached, with a prior of `prior_mean` worth `prior_weight` observations."""

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
        """A step whose first draft failed, `fed` runners-up fed, runner-up `hit` AR's token (-1: none):
        under source "runner_up", slot k is reached where runner-up k was fed, kept where it was hit."""
        reached, kept = self._lists("runner_up", fed)
        for k in range(fed):
            reached[k] += 1
        if 0 <= hit < fed:
            kept[hit] += 1

    def rate(self, source: str, j: int) -> float:
        reached, kept = self._lists(source, j + 1)
        return (kept[j] + self.prior_mean * self.prior_weight) / (reached[j] + self.prior_weight)

    def rates(self, source: str, n: int) -> list[float]:
        reached, kept = self._lists(source, n)
        m, w = self.prior_mean * self.prior_weight, self.prior_weight
        return [(kept[j] + m) / (reached[j] + w) for j in range(n)]

    def expected_kept(self, source: str, n: int) -> float:
        """Expected drafts kept out of the first n of this source."""
        return self.expected_kept_each(source, n)[-1] if n else 0.0

    def expected_kept_each(self, source: str, n: int) -> list[float]:
        """Expected drafts kept out of the first d of this source, for d = 1 .. n: the running
        product of the keep rates (the chance the first d are all kept), summed in order, the
        floats numpy's cumprod and cumsum give."""
        out, reach, total = [], 1.0, 0.0
        for r in self.rates(source, n):
            reach *= r
            total += reach
            out.append(total)
        return out


def steady_state(
    mask_rates: list[float], spare_rates: list[float], masks: int, groups: int, batch: int = 1
) -> tuple[float, float, float]:
    """(tokens per step and row, mean fed width per row, fraction of steps with drafts) of feeding
    `masks` masks and `groups` spare groups forever: a chain over steps with mask drafts (M),
    spare-group drafts (S) and none (N). Of d = masks drafts with keep rates r, exactly g are kept
    with chance prod(r[:g]) (1 - r[g]): all kept -> M, g < groups -> S, else N; N -> M. A batch's
    forward is as wide as its widest row, so with `batch` rows each drafting a fraction f of steps,
    every row pays the drafting width with chance 1 - (1 - f)^batch."""
    if masks == 0:
        return 1.0, 1.0, 0.0

    mask = _outcomes(mask_rates, masks, groups)
    spare = _outcomes(spare_rates, masks, groups)
    return _chain(mask, spare, masks, groups, batch)


def _outcomes(rates, masks: int, most_groups: int) -> tuple[float, float, list[float]]:
    """Of `masks` drafts with keep rates `rates`: (expected kept, chance all are kept, and per g up
    to `most_groups` the chance that exactly g' < g are kept), each summed in the drafts' order."""
    per_masks, by_groups = _outcomes_upto(rates, masks, most_groups)
    return (*per_masks[masks], by_groups)


def _outcomes_upto(rates, masks: int, most_groups: int) -> tuple[list[tuple[float, float]], list[float]]:
    """`_outcomes` for every mask count up to `masks` in one pass: per count m, (expected kept, chance
    all are kept); and the per-g chances of `masks`, whose first min(m, most_groups) + 1 are m's (the
    same sums, taken in the same order)."""
    reach, kept, to_s, by_groups = 1.0, 0.0, 0.0, [0.0]  # reach: chance the first g drafts were kept
    per_masks = [(kept, reach)]
    for g in range(masks):
        if g < most_groups:
            to_s += reach * (1.0 - rates[g])  # exactly g kept, and group g's proposals follow
            by_groups.append(to_s)
        reach *= rates[g]
        kept += reach
        per_masks.append((kept, reach))
    return per_masks, by_groups


def _chain(mask, spare, masks: int, groups: int, batch: int) -> tuple[float, float, float]:
    """steady_state's stationary chain from the masks' and the spare groups' `_outcomes`."""
    (km, mm, mask_to_s), (ks, sm, spare_to_s) = mask, spare
    ms, ss = mask_to_s[min(groups, masks)], spare_to_s[min(groups, masks)]
    mn, sn = 1.0 - mm - ms, 1.0 - sm - ss
    # Stationary distribution in closed form: N always leads to M, so pi_S = pi_M ms / (1 - ss) and
    # pi_N = pi_M mn + pi_S sn (1 - ss > 0: DraftStats' prior keeps every keep rate below 1).
    s_per_m = ms / max(1.0 - ss, 1e-12)
    n_per_m = mn + s_per_m * sn
    pi_m = 1.0 / (1.0 + s_per_m + n_per_m)
    pi_s, pi_n = s_per_m * pi_m, n_per_m * pi_m
    tokens = pi_m * (1 + km) + pi_s * (1 + ks) + pi_n
    drafting = pi_m + pi_s
    narrow, wide = 1 + masks, 1 + masks + masks + groups * masks
    width = narrow + (wide - narrow) * (1.0 - (1.0 - drafting) ** batch)
    return float(tokens), float(width), drafting


class LosslessFeed:
    """Per step, the masks and spare groups a lossless window step feeds: the choice with the most
    expected tokens per second (`rate`), AR's own feed (0, 0) included. Lossless output is AR's
    whatever is fed, so one feed per loaded model may learn from timings across calls. AR's feed
    teaches nothing about the masks, so after `explore` AR steps in a row the feed probes the next
    best choice for two steps (one proposes drafts, the next verifies them) so that estimates that
    went too low can recover; each probe that leaves AR best doubles the wait."""

    source = MASKS  # the draft source whose keep rates `block_tokens` reads

    def __init__(
        self,
        curve: CostCurve | BatchCosts,
        max_masks: int,
        max_groups: int,
        *,
        stats: DraftStats | None = None,
        explore: int = 32,
    ):
        self.costs = curve if isinstance(curve, BatchCosts) else BatchCosts(curve)
        self.max_masks = max_masks
        self.max_groups = max_groups
        self.stats = stats or DraftStats(slots=max_masks)
        self.explore = explore
        self.choices: dict[tuple[int, int], int] = {}  # (masks, groups) -> steps that fed it
        # [used, offered]: row steps with in-forward drafts on offer, and those that took them over lookup's.
        self.mask_use = [0, 0]
        self._ar_run = 0
        self._probe = 0
        self._interval = explore  # AR steps in a row before the next probe
        self._steady_for = None  # (its key, `_steady`'s candidates)

    @classmethod
    def for_plan(cls, curve: CostCurve | BatchCosts, plan, *, explore: int = 32) -> LosslessFeed:
        """The feed of a plan's lossless loop: its block size and its spare groups on the window cache."""
        return cls(curve, plan.block_size, plan.window_spare_groups, explore=explore)

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
        """How often the masks' drafts were taken where on offer (prior 1/2): lookup drafts often win."""
        used, offered = self.mask_use
        return (used + 1.0) / (offered + 2.0)

    def rate(self, masks: int, groups: int, batch: int = 1) -> float:
        """Expected tokens per second and row of feeding this forever, mask drafts counted where taken."""
        s = self.stats
        tokens, width, _ = steady_state(s.rates(MASKS, masks), s.rates(SPARE, masks), masks, groups, batch)
        return self._per_second(tokens, width, self.used(), batch)

    def _per_second(self, tokens: float, width: float, used: float, batch: int) -> float:
        return (1.0 + used * (tokens - 1.0)) / self.costs.seconds(batch, width)

    def _steady(self, batch: int) -> list[tuple[int, int, float, float]]:
        """Per candidate past AR's, (masks, groups, tokens, width) of feeding it forever (`_chain`),
        every mask count's outcomes summed in one pass (`_outcomes_upto`); kept while the keep rates
        and the batch stay as they were (a step whose drafts came from a lookup leaves them)."""
        s = self.stats
        mask_rates, spare_rates = s.rates(MASKS, self.max_masks), s.rates(SPARE, self.max_masks)
        key = (batch, self.max_masks, self.max_groups, tuple(mask_rates), tuple(spare_rates))
        if self._steady_for is None or self._steady_for[0] != key:
            out = []
            mask_each, mask_groups = _outcomes_upto(mask_rates, self.max_masks, self.max_groups)
            spare_each, spare_groups = _outcomes_upto(spare_rates, self.max_masks, self.max_groups)
            for m in range(1, self.max_masks + 1):
                most = min(m, self.max_groups)
                mask, spare = (*mask_each[m], mask_groups), (*spare_each[m], spare_groups)
                for g in range(most + 1):
                    tokens, width, _ = _chain(mask, spare, m, g, batch)
                    out.append((m, g, tokens, width))
            self._steady_for = (key, out)
        return self._steady_for[1]

    def _scored(self, batch: int) -> list[tuple[tuple[float, int, int], tuple[int, int]]]:
        """Per candidate, ((its `rate`, -masks, -groups), (masks, groups)): each `rate` from
        `_steady`'s tokens and widths (the same floats). The keys differ, so they order the
        candidates as `_ranked` does."""
        used, steady = self.used(), self._steady(batch)
        # Every candidate's forward cost in one call (AR's width 1 first): the floats `seconds` gives.
        seconds = self.costs.seconds_of(batch, [1.0] + [width for _, _, _, width in steady])
        keyed = [(((1.0 + used * (1.0 - 1.0)) / seconds[0], 0, 0), (0, 0))]
        for (m, g, tokens, _), cost in zip(steady, seconds[1:]):
            keyed.append((((1.0 + used * (tokens - 1.0)) / cost, -m, -g), (m, g)))
        return keyed

    def _ranked(self, batch: int) -> list[tuple[int, int]]:
        """The candidates, the highest `rate` first (ties: fewer masks, then fewer groups)."""
        return [c for _, c in sorted(self._scored(batch), key=lambda kc: kc[0], reverse=True)]

    def choose(self, batch: int = 1) -> tuple[int, int]:
        scored = self._scored(batch)
        best = max(scored)[1]  # `_ranked`'s first, without ranking the rest (the keys differ: never a tie)
        if best == (0, 0) and self.max_masks:
            if not self._probe:
                self._ar_run += 1
                if self._ar_run > self._interval:
                    self._ar_run, self._probe = 0, 2
                    self._interval = min(2 * self._interval, 32 * self.explore)
            if self._probe:
                self._probe -= 1
                best = [c for _, c in sorted(scored, key=lambda kc: kc[0], reverse=True)][1]
        else:
            self._ar_run = 0
            self._interval = self.explore
        self.choices[best] = self.choices.get(best, 0) + 1
        return best

    def fits(self, max_masks: int, max_groups: int) -> bool:
        return (self.max_masks, self.max_groups) == (max_masks, max_groups)

    def block_tokens(self, slots: int) -> float:
        """Expected tokens of a block-cache step whose masks may give `slots` more: 1 + the kept run."""
        return 1.0 + self.stats.expected_kept(self.source, slots)


class ThresholdFeed(LosslessFeed):
    """Per step, how many of the B masks a threshold-mode step feeds (docs/method.md §9): feeding m
    forever takes 1 + sum_j P(run >= j) tokens a step for a forward of the widest row's uncached
    tokens (1 + its last run) plus m. What is fed changes the text, so the feed decides on a
    `BatchCosts.snapshot` and one call's statistics, never on timing noise or earlier calls."""

    source = "threshold"

    def __init__(self, curve: CostCurve | BatchCosts | LosslessFeed, max_masks: int, *, explore: int = 32):
        super().__init__(frozen_costs(curve), max_masks, 0, explore=explore)

    def candidates(self):
        for m in range(self.max_masks + 1):
            yield m, 0

    def _scored(self, batch: int) -> list[tuple[tuple[float, int, int], tuple[int, int]]]:
        return [((self.rate(*c, batch=batch), -c[0], -c[1]), c) for c in self.candidates()]

    def rate(self, masks: int, groups: int = 0, batch: int = 1) -> float:
        reach = np.cumprod(self.stats.rates(self.source, masks))  # P(run >= j), j = 1..masks
        tokens = 1.0 + float(reach.sum())
        # The widest of `batch` rows feeds 1 + its last run (expected max over the rows) + m.
        widest_run = float(np.sum(1.0 - (1.0 - reach) ** batch))
        return tokens / self.costs.seconds(batch, 1 + masks + widest_run)

    def record(self, fed: int, taken: int) -> None:
        """A row's step: `taken` of the `fed` masks it could take (its limit less the AR token)."""
        self.stats.record(self.source, fed, taken)


def frozen_costs(cost: CostCurve | BatchCosts | LosslessFeed) -> BatchCosts:
    """A `BatchCosts.snapshot` of the curves behind `cost` (a feed's, a batch's or one curve)."""
    costs = cost.costs if isinstance(cost, LosslessFeed) else cost
    return (costs if isinstance(costs, BatchCosts) else BatchCosts(costs)).snapshot()


def block_cache_pays(
    cost: CostCurve | BatchCosts | LosslessFeed, block_size: int, block_cache: int, spare_groups: int, batch: int
) -> bool:
    """Whether `batch` rows are expected to decode faster on the block cache than on the window cache
    with the cost-aware feed: a block step feeds about B_cache + t tokens a row for t taken (one AR
    token plus the drafts kept out of min(B, B_cache - 1))."""
    feed = cost if isinstance(cost, LosslessFeed) else LosslessFeed(cost, block_size, spare_groups)
    tokens = feed.block_tokens(min(block_size, block_cache - 1))
    block = tokens / feed.costs.seconds(batch, block_cache + tokens)
    window = max(feed.rate(m, g, batch=batch) for m, g in feed.candidates())
    return block >= window


class FeedController:
    """The feed of one loaded model, kept between calls: its cost curves, measured when first needed
    (`measure`) or given (`costs`), live (refreshed by lossless decoding from the forwards it times)
    and as measured (`stored`, for the modes whose text depends on the feed), and one lossless feed
    per block size, spare-group cap and kind of decoding, learning across calls."""

    def __init__(
        self,
        costs: CostCurve | BatchCosts | None = None,
        *,
        measure: Callable[[], BatchCosts] | None = None,
        explore: int = 32,
    ):
        if costs is None and measure is None:
            raise ValueError("a feed controller needs cost curves or a way to measure them")
        self._measure = measure
        self._live: BatchCosts | None = None
        self._stored: BatchCosts | None = None
        if costs is not None:
            self._set(costs)
        self.explore = explore  # the feeds' probing (LosslessFeed)
        self.feeds: dict[tuple, LosslessFeed] = {}

    def _set(self, costs: CostCurve | BatchCosts) -> None:
        self._live = costs if isinstance(costs, BatchCosts) else BatchCosts(costs)
        self._stored = self._live.snapshot()

    @property
    def costs(self) -> BatchCosts:
        """The live curves (measured now if they never were)."""
        if self._live is None:
            self._set(self._measure())
        return self._live

    @property
    def stored(self) -> BatchCosts:
        """The curves as measured, which no timed forward refreshes."""
        self.costs
        return self._stored

    @staticmethod
    def uses(plan: Plan) -> bool:
        """Whether a plan decodes with a chosen feed: "auto", below AR mode."""
        return plan.feed == "auto" and plan.mode is not Mode.AR

    def prepare(self, plan: Plan, batch: int = 1) -> None:
        """Measure now every curve a call of `plan` over up to `batch` rows may need."""
        if self.uses(plan):
            self.prepare_all(batch, stored=plan.mode is not Mode.LOSSLESS)

    def prepare_all(self, batch: int, *, stored: bool = True) -> None:
        """Measure now the live curves of every batch size up to `batch` (and, with `stored`,
        the stored copy's: curves measured after the copy was taken are its own)."""
        self.costs.prepare(batch)
        if stored:
            self._stored.prepare(batch)

    def feed_for(self, plan: Plan) -> LosslessFeed:
        """The plan's lossless feed feed, kept across calls."""
        key = (plan.block_size, plan.window_spare_groups, plan.sampling.greedy)
        if key not in self.feeds:
            self.feeds[key] = LosslessFeed.for_plan(self.costs, plan, explore=self.explore)
        return self.feeds[key]
