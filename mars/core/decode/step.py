"""One step of the decoding loop in three parts, each a function (docs/design.md, "One step"):

- `decide`: the one place a step is decided. The feed's choice (how many masks and spare groups),
  each row's drafts and their source (drafting), the alternative and tree groups, then the strategy's
  layout (ids, positions, holes, reads, the draft and group columns) and its attention mask, frozen
  together in a `StepSpec`. Nothing writes the strategy or the rows again until `apply`.
- `run`: the backend's one forward over the spec and the mode's acceptance (threshold acceptance, or
  verification of the drafts with, in verified threshold mode, the confident next drafts taken), as
  one `Outcome` whose fields are the same whatever the mode and what was asked.
- `apply`: the outcome written into the rows (tokens taken, next drafts, statistics, log-probabilities)
  and the feeds' learning; the strategy's commit follows (mars.core.decode.loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .drafts.tree import RANKS, branches, row_paths
from .execution import Execution
from .layout import Layout
from .plan import Mode
from .types import DecodeStats, Row, TokenLogprob
from .verify import Verdict, accept_by_threshold, count_drafts, take_confident, verify


@dataclass(frozen=True)
class StepSpec:
    """A step as decided (`decide`): what it feeds (`layout`, whose `ids` give the fed width), under which
    attention mask, and the feed's choice of (masks, spare groups) where a feed chose (None: the plan's)."""

    layout: Layout
    mask: np.ndarray
    choice: tuple[int, int] | None

    @property
    def width(self) -> int:
        return self.layout.width


@dataclass(frozen=True)
class Outcome:
    """What a step decided for its rows, the same fields in every mode (`run`).

    `accepted`: per row, the tokens it takes (none for a waiting row); `logprobs`: per row, theirs
    (empty lists where the plan asks for none); `verdict`: where the step verified drafts, the
    verifier's `Verdict` (kept drafts, next drafts and their runners-up, groups, ranks), else None;
    `taken`: per row, the confident next drafts taken unverified (verified threshold mode; zeros
    elsewhere); `seconds`: the backend step's wall time."""

    accepted: list[list[int]]
    logprobs: list[list[TokenLogprob]]
    verdict: Verdict | None
    taken: list[int]
    seconds: float


def decide(run: Execution, strategy, rows: list[Row], stats: DecodeStats) -> StepSpec:
    """The step the rows take next: the feed's choice and the drafts (Execution.choose, which alone
    sets the masks, groups and drafts), then the strategy's layout and mask."""
    choice = run.choose(strategy, rows, stats)
    layout = strategy.lay_out(rows)
    return StepSpec(layout, strategy.mask(layout), choice)


def run_step(backend, cache, spec: StepSpec, run: Execution, rows: list[Row]) -> Outcome:
    """One backend step over `spec` and the mode's acceptance."""
    s, layout = run.plan, spec.layout
    t0 = time.perf_counter()
    if not s.verifies:
        accepted, logprobs = accept_by_threshold(backend, cache, layout, spec.mask, rows, s)
        seconds = time.perf_counter() - t0
        return Outcome(accepted, logprobs or [[] for _ in rows], None, [0] * len(rows), seconds)
    confident = s.mode is Mode.VERIFIED
    verdict = verify(
        backend,
        cache,
        layout,
        spec.mask,
        s.sampling,
        metric=s.metric if confident else None,
        runners_up=s.alternative_groups,
        logprobs=s.logprobs,
        ranks=RANKS if s.tree_nodes else 0,
    )
    seconds = time.perf_counter() - t0
    taken = [0] * len(rows)
    if confident:
        taken = take_confident(verdict.accepted, verdict.nxt, verdict.conf, rows, s.metric, verdict)
    logprobs = verdict.logprobs if verdict.logprobs is not None else [[] for _ in rows]
    return Outcome(verdict.accepted, logprobs, verdict, taken, seconds)


def apply(outcome: Outcome, spec: StepSpec, rows: list[Row], run: Execution, stats: DecodeStats):
    """Write `outcome` into the rows and the run's feeds; returns (per row the tokens it took, per row
    the fed tokens it commits to the cache: its real tokens, kept drafts included)."""
    s, layout, verdict = run.plan, spec.layout, outcome.verdict
    stats.forwards += 1
    stats.fed_tokens += layout.batch * layout.width
    accepted = [list(a) for a in outcome.accepted]
    if verdict is not None:
        if run.drafting is not None:
            run.drafting.after_step(layout, verdict, rows, outcome.seconds)
    else:
        stats.masks_fed[layout.columns.masks] = stats.masks_fed.get(layout.columns.masks, 0) + 1
        if run.threshold_feed is not None:
            for i, limit in enumerate(layout.lists("limit")):
                if limit > 0:
                    run.threshold_feed.record(limit - 1, len(accepted[i]) - 1)
    # What each row had fed for real: the cached variants commit it (kept drafts too).
    before = [len(r.seq) if not r.done else r.cached for r in rows]
    eos = set(s.eos_ids)
    if verdict is not None:
        fed, kept = layout.lists("n_drafts"), verdict.kept
    for i, r in enumerate(rows):
        if r.done:
            accepted[i] = []
            continue
        if not accepted[i]:
            r.stats.waited += 1
            continue
        if verdict is not None:
            _apply_verdict(r, i, verdict, outcome.taken[i], layout, fed[i], kept[i], s)
            before[i] += kept[i]
        accepted[i] = take(r, accepted[i], eos)
        if s.logprobs is not None:
            r.logprobs.extend(outcome.logprobs[i][: len(accepted[i])])
    return accepted, before


def _apply_verdict(r: Row, i: int, verdict: Verdict, taken: int, layout: Layout, fed: int, kept: int, s) -> None:
    """Row i's drafts and statistics after a step that verified them (it took tokens): it had fed
    `fed` drafts and kept `kept`."""
    count_drafts(r, fed, kept, verdict.nxt[i], s.masks_per_step)
    # The runners-up of the next first draft: after confident drafts taken unverified, the first left.
    r.alts = verdict.next_alts[i][taken] if taken < len(verdict.next_alts[i]) else []
    if verdict.group[i] >= 0:  # AR's tokens after a confirmed group prefix count under its source
        group, m = layout.columns.groups[verdict.group[i]], verdict.matched[i]
        if m:
            r.stats.by_source[group.source] = r.stats.by_source.get(group.source, 0) + m
    if verdict.next_top is not None:  # the tree's branches off the next drafts
        top_ids, top_logp, own = verdict.next_top[i]
        # As many as the tree may feed beside the runner-up groups, which the same nodes would repeat.
        most = s.tree_nodes + s.alternative_groups
        r.branches = branches(top_ids[taken:], top_logp[taken:], most, r.drafts, own[taken:])
        r.tree_chain = list(r.drafts)
        # The tree off these drafts; on the window cache the drafting widens it with the other sources'.
        r.paths = row_paths(r, longest=s.block_size, single=not s.sampling.greedy)
    if taken:
        r.stats.by_source["threshold"] = r.stats.by_source.get("threshold", 0) + taken


def take(r: Row, new: list[int], eos: set[int]) -> list[int]:
    """Row r takes `new` (cut after an accepted EOS) and counts the forward; it finishes at
    an accepted EOS or at its max_tokens. Returns what it took."""
    for j, t in enumerate(new):
        if t in eos:
            new = new[: j + 1]
            r.done, r.finish = True, "eos"
            break
    r.seq.extend(new)
    r.stats.forwards += 1
    r.stats.accepted += len(new)
    per_slot = r.stats.accepted_per_slot
    per_slot.extend([0] * (len(new) - len(per_slot)))  # n-gram drafts may outnumber the masks
    for j in range(len(new)):
        per_slot[j] += 1
    if not r.done and r.produced >= r.max_tokens:
        r.done, r.finish = True, "length"
    return new
