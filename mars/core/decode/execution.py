"""How a run executes, decided once (`execution`) from its plan and the model's feed controller:
the cache strategy that runs, the drafting of a run that verifies drafts, and what chooses each
step's feed (a feed on the measured cost curves, or the plan's fixed feed)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..acceptance import ar_mode_rows
from .drafting import Drafting
from .drafts import SPARE
from .feed import FeedController, LosslessFeed, ThresholdFeed, block_cache_pays
from .plan import AUTO_TREE, Mode, Plan
from .types import DecodeStats, Row


@dataclass
class Execution:
    """One call of the loop (or one served batch, `served`): `plan` with the cache strategy that runs,
    `drafting` where drafts are verified on the window cache, and `lossless_feed` (a step that
    verifies drafts) or `threshold_feed` where the feed is measured."""

    plan: Plan
    drafting: Drafting | None = None
    lossless_feed: LosslessFeed | None = None
    threshold_feed: ThresholdFeed | None = None
    served: bool = False

    def choose(self, strategy, rows: list[Row], stats: DecodeStats) -> tuple[int, int] | None:
        """Before a step (step.decide): the masks (and spare groups) it feeds, then each row's drafts;
        returns the feed's choice of (masks, spare groups), None where no feed chose. The only place
        a step's width is set."""
        s = self.plan
        batch = max(1, len(rows))  # a finished row not yet dropped still takes its slots
        if self.served:  # rows of a served batch decode at their own thresholds
            all_ar = ar_mode_rows(s.metric, [r.threshold for r in rows]).all()
            strategy.masks = 0 if all_ar and not s.verifies else s.block_size
        choice = None
        if self.lossless_feed is not None and self.drafting is not None:
            strategy.masks, strategy.group_counts[SPARE] = choice = self.lossless_feed.choose(batch=batch)
        if self.threshold_feed is not None:
            strategy.masks = self.threshold_feed.choose(batch=batch)[0]
            choice = (strategy.masks, 0)
        if self.drafting is not None:
            self.drafting.before_step(strategy, rows)
        if choice is not None:
            stats.feed_choices[choice] = stats.feed_choices.get(choice, 0) + 1
        return choice

    def report(self, stats: DecodeStats) -> None:
        """The drafting statistics as they stand, into `stats` (plain copies)."""
        if self.drafting is not None:
            draft = self.drafting.stats
            stats.draft_reached = {k: list(v) for k, v in draft.reached.items()}
            stats.draft_kept = {k: list(v) for k, v in draft.kept.items()}


def execution(plan: Plan, controller: FeedController | None, batch: int, *, served: bool = False) -> Execution:
    """How a call of `plan` over `batch` rows runs (a served batch, `served`, keeps its cache and
    feeds threshold mode's masks as its rows' thresholds ask). Without a controller, or with a
    plan whose feed is fixed, every step feeds what the plan says."""
    cache, lossless, threshold, learn = plan.cache, None, None, False
    if controller is not None and controller.uses(plan):
        controller.prepare(plan, batch)
        if plan.mode is Mode.VERIFIED:
            # What it feeds changes the text: a fresh feed per call on a frozen copy of the curves.
            lossless = LosslessFeed.for_plan(controller.stored.snapshot(), plan)
        elif plan.mode is Mode.THRESHOLD:
            if not served:  # one feed per call, on a frozen copy
                threshold = ThresholdFeed(controller.stored, plan.block_size, explore=controller.explore)
                if cache == "block" and not block_cache_pays(threshold, plan.block_size, plan.block_cache, 0, batch):
                    cache = "window"
        elif not (
            cache == "block"
            and (
                served
                or not plan.sampling.greedy
                or block_cache_pays(
                    controller.feed_for(plan), plan.block_size, plan.block_cache, plan.window_spare_groups, batch
                )
            )
        ):
            # Lossless: the measured feed on the window cache, unless the block cache pays.
            cache, lossless, learn = "window" if cache == "block" else cache, controller.feed_for(plan), True
    run = plan if cache == plan.cache else replace(plan, cache=cache)
    if run.drafts.tree == "auto":  # lossless: trees where a measured feed sizes them per step (Drafting._tree_nodes)
        pays = lossless is not None and run.mode is Mode.LOSSLESS and trees_pay(lossless.costs, run.block_size, batch)
        run = replace(run, drafts=replace(run.drafts, tree=AUTO_TREE if pays else 0))
    drafting = None
    if run.verifies and cache != "block" and (run.sampling.greedy or (lossless is not None and not served)):
        # Sampled lossless decoding drafts with a measured feed only; its output distribution stays AR's.
        drafting = Drafting(run, lossless, learn=learn)
    return Execution(run, drafting, lossless if drafting is not None else None, threshold, served)


# "auto" feeds trees where a node's group (its id and B masks) costs at most TREE_GROUP_COST of the
# step it joins, averaged over TREE_GROUPS groups: one group's cost falls between a probed curve's few
# widths and read alone it came out 1.03 to 1.15x a step on the default model's curves kept on this
# CPU. Four groups cost 1.48-1.86x a 9-token step there (12-21% each), and the default mode with
# trees ran 0.95x the default mode without them; on a flat curve (an overhead-bound device) it took
# 2.74 tokens per forward against 2.30 (benchmarks/README.md, "Token trees").
TREE_GROUP_COST = 0.05
TREE_GROUPS = 4


def trees_pay(costs, block_size: int, batch: int = 1) -> bool:
    """Whether "auto" trees may pay on this cost curve: TREE_GROUPS nodes' groups (1 + B fed tokens
    each) added to a lossless step of B masks and a spare group (1 + 2B) cost at most TREE_GROUP_COST
    of the step each."""
    step = 1 + 2 * block_size
    wider = costs.seconds(batch, step + TREE_GROUPS * (1 + block_size))
    return wider <= (1 + TREE_GROUPS * TREE_GROUP_COST) * costs.seconds(batch, step)
