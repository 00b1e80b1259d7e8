"""The drafts of a window step that verifies them (docs/method.md §9): which source's drafts
each row feeds (mars.core.decode.drafts), and how many masks and groups a step feeds."""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from .drafts import ALT, IN_FORWARD, MASKS, SPARE, TREE, lookup_sources
from .drafts.tree import row_paths
from .feed import DraftStats, LosslessFeed
from .layout import Layout, lossless_width
from .plan import Plan
from .strategies import WindowStrategy
from .types import Row
from .verify import Verdict


class Drafting:
    """Which drafts each row of a window step that verifies them feeds, and how many alternative
    groups the step feeds, given its masks and spare groups: a row drafts from lookup where that is
    expected to keep more; with a cost curve, the drafts' common length and the alternative groups
    maximise expected tokens per second (sampled decoding: the mask drafts' length alone)."""

    def __init__(self, settings: Plan, feed: LosslessFeed | None, *, learn: bool = True):
        self.s = settings
        self.feed = feed
        # False where what a step feeds changes the text (verified threshold mode): no timing refreshes a curve.
        self.learn = learn
        self.stats = feed.stats if feed is not None else DraftStats(slots=settings.block_size)
        self.lookups = lookup_sources(settings)
        self._keys: list[str] = []  # per row of the step: the statistics its drafts count under

    def before_step(self, strategy: WindowStrategy, rows: list[Row]) -> None:
        batch = max(1, len(rows))  # the rows of the forward: a finished row not yet dropped still takes its slots
        m, g = strategy.masks, strategy.group_counts[SPARE]  # as the step's feed set them (Execution.choose)
        self._keys = [r.source for r in rows]
        live, owns, options = [], [], []
        for i, r in enumerate(rows):
            if r.done:
                continue
            live.append(i)
            owns.append(r.drafts[:1])
            row_options = [(r.source, r.source, r.drafts[: max(m, 1)])] if r.drafts else []
            for lookup in self.lookups:
                found = lookup.propose(r.seq, self.s.lookup_drafts)
                if found is not None:
                    row_options.append((lookup.name, *found))
            options.append(row_options)
        picks = self._pick_all(options, m, g, batch)
        if self.feed is not None:  # how often the masks' drafts win where they are on offer (LosslessFeed.used)
            for row_options, (source, _, drafts) in zip(options, picks):
                if any(o[0] in IN_FORWARD for o in row_options):
                    self.feed.mask_use[1] += 1
                    self.feed.mask_use[0] += bool(drafts) and source in IN_FORWARD
        for i, own, choice in zip(live, owns, picks):
            r = rows[i]
            r.source, self._keys[i], r.drafts = choice
            if r.source not in IN_FORWARD:  # lookup's first draft's runners-up: the masks' draft, then its own
                r.alts = [t for t in dict.fromkeys(own + r.alts) if t != r.drafts[0]] if own else []
        if self.s.alternative_groups:
            strategy.group_counts[ALT] = self._alternatives(rows, m, g, batch)
        if self.s.tree_nodes:
            alt_fed = strategy.group_counts.get(ALT, 0)
            for i in live:
                self._tree(rows[i], rows[i].alts[:alt_fed])
            strategy.group_counts[TREE] = self._tree_nodes(rows, m, g, strategy.group_counts.get(ALT, 0), batch)

    def _tree(self, r: Row, alts: list[int]) -> None:
        """Row r's tree for the step (drafts/tree.paths) off the chain it feeds: the masks' branches,
        weighted by their path probability under the masks. Where a lookup's chain is fed and leaves
        the masks' chain before a branch's node, the branch joins as a path of the masks' drafts from
        there and its node (greedy; a sampled tree takes single nodes)."""
        r.paths = row_paths(r, longest=self.s.block_size, single=not self.s.sampling.greedy, fed=alts)

    def _tree_nodes(self, rows: list[Row], masks: int, spare_groups: int, alt_groups: int, batch: int) -> int:
        """How many tree nodes the step feeds (drafts/tree.py): all allowed without a cost curve; with
        one, the number with the most expected tokens per second, a node adding a token with its
        path's probability under the masks (each row's most probable nodes first)."""
        most = self.s.tree_nodes
        if self.feed is None:
            return most
        live = [(r, key) for r, key in zip(rows, self._keys) if not r.done and r.drafts and r.paths]
        if not live or not masks:
            return 0
        st = self.stats
        base = batch + sum(float(st.expected_kept(key, len(r.drafts))) for r, key in live)
        widest = max(len(r.drafts) for r, _ in live)
        gains, extra = np.zeros(most + 1), np.zeros(most + 1, dtype=np.int64)
        for r, _ in live:
            p = [w for _, _, w in r.paths[:most]]
            gains[1 : len(p) + 1] += np.cumsum(p)
            gains[len(p) + 1 :] += sum(p)
            cols = np.cumsum([len(prefix) + masks for _, prefix, _ in r.paths[:most]])
            row_extra = np.concatenate([[0], cols, np.full(most - len(cols), cols[-1] if len(cols) else 0)])
            extra = np.maximum(extra, row_extra)  # a step is as wide as its widest row
        costs = self.feed.costs
        plain = lossless_width(widest, masks, spare_groups, alt_groups)
        scores = [(base + gains[n]) / costs.seconds(batch, plain + int(extra[n])) for n in range(most + 1)]
        return int(np.argmax(scores))

    def _alternatives(self, rows: list[Row], masks: int, spare_groups: int, batch: int) -> int:
        """How many alternative groups the step feeds: all allowed without a cost curve; with one, the
        number with the most expected tokens per second, runner-up k adding a token with the chance
        that the first draft fails and runner-up k is AR's token (source "runner_up", slot k)."""
        most = self.s.alternative_groups
        if self.feed is None:
            return most
        st = self.stats
        live = [(r, key) for r, key in zip(rows, self._keys) if not r.done and r.drafts]
        if not live:
            return 0
        base = batch + sum(float(st.expected_kept(key, len(r.drafts))) for r, key in live)
        widest = max(len(r.drafts) for r, _ in live)
        # Each count's forward cost in one call (the floats `seconds` gives).
        seconds = self.feed.costs.seconds_of(
            batch, [lossless_width(widest, masks, spare_groups, a) for a in range(most + 1)]
        )
        best, best_score = 0, base / seconds[0]
        miss = [(1.0 - st.rate(key, 0), len(r.alts)) for r, key in live]
        # [a]: chance one of the first a runners-up is AR's token (summed in order, as np.cumsum does)
        hits = list(accumulate([0.0] + st.rates("runner_up", most)))
        for a in range(1, most + 1):
            gain = sum(p * min(1.0, hits[min(n, a)]) for p, n in miss)
            score = (base + gain) / seconds[a]
            if score > best_score:
                best, best_score = a, score
        return best

    def _pick_all(
        self, options: list[list], masks: int, spare_groups: int, batch: int
    ) -> list[tuple[str, str, list[int]]]:
        """The drafts each row feeds, (source, statistics key, drafts), from its `options` of that
        form: without a cost curve each row's option expected to keep the most; with one, each row's
        best option cut to the common length d (0: no drafts) with the most expected tokens per second
        for the step, decided for the batch together since a step is as wide as its widest row."""
        # Per row and option, the expected drafts kept out of its first n, at [n - 1].
        kept_each = [
            [self.stats.expected_kept_each(key, len(drafts)) for _, key, drafts in row_options]
            for row_options in options
        ]

        def best(row, d):
            """A row's option with the most expected kept drafts among its first d (ties: the first
            option), as (option index, drafts fed, expected kept); None without options. `row`:
            per option, (its drafts' count, its expected kept drafts out of the first n at [n - 1])."""
            top = None
            for j, (length, kept) in enumerate(row):
                n = d if d < length else length
                if top is None or kept[n - 1] > top[2]:  # ties: the first option
                    top = (j, n, kept[n - 1])
            return top

        rows = [[(len(drafts), k) for (_, _, drafts), k in zip(o, kept)] for o, kept in zip(options, kept_each)]
        longest = max((length for row in rows for length, _ in row), default=0)
        best_d = longest  # without a cost curve: each row's whole best option
        if self.feed is not None:
            seconds, asked = self.feed.costs.seconds, {}  # asked: a step's cost by its widest drafts, once

            def cost(widest: int) -> float:
                found = asked.get(widest)
                if found is None:
                    found = asked[widest] = seconds(batch, lossless_width(widest, masks, spare_groups))
                return found

            best_d, best_score = 0, batch / cost(0)
            # The most a step's picks may keep: each row's best option whole. A longer d keeps no more
            # and is no narrower (a row's pick only grows with d), and the curve never falls: once even
            # that much at d's cost cannot beat the best, no longer d can.
            most = batch + sum(max(kept[-1] for _, kept in row) for row in rows if row)
            for d in range(1, longest + 1):
                widest, total = 0, 0  # the widest pick, and the picks' kept drafts summed in order
                for row in rows:  # `best(row, d)`, inline: this loop runs for every d a lookup offers
                    top, fed = None, 0
                    for length, kept in row:
                        n = d if d < length else length
                        if top is None or kept[n - 1] > top:  # ties: the first option
                            top, fed = kept[n - 1], n
                    if top is not None:
                        total += top
                        widest = max(widest, fed)
                found = asked.get(widest)
                seconds_d = found if found is not None else cost(widest)
                score = (batch + total) / seconds_d
                if score > best_score:
                    best_d, best_score = d, score
                elif most / seconds_d <= best_score:
                    break
        picks = []
        for row_options, row in zip(options, rows):
            chosen = best(row, best_d) if best_d else None
            if chosen is None:
                picks.append((MASKS, MASKS, []))
            else:
                source, key, drafts = row_options[chosen[0]]
                picks.append((source, key, drafts[: chosen[1]]))
        return picks

    def after_step(self, layout: Layout, verdict: Verdict, rows: list[Row], seconds: float) -> None:
        n_alts = layout.live_groups(ALT)
        # Which runner-up alternative was AR's token, per row (-1: none): the chosen group's place among them.
        alt_groups = [k for k, g in enumerate(layout.columns.groups) if g.source == ALT]
        limit, fed = layout.lists("limit"), layout.lists("n_drafts")
        kept, group = verdict.kept, verdict.group
        for i in range(len(rows)):
            if limit[i] > 0 and fed[i]:
                self.stats.record(self._keys[i], fed[i], kept[i])
                if n_alts is not None and n_alts[i] and not kept[i]:
                    hit = alt_groups.index(group[i]) if group[i] in alt_groups else -1
                    self.stats.record_alternatives(n_alts[i], hit)
        if self.feed is not None and self.learn:
            self.feed.costs.observe(layout.batch, layout.width, seconds)
