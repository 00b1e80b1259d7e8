"""The cache strategies (docs/method.md §5-6): what each row feeds on its committed cache, and
what the cache keeps after the step."""

from __future__ import annotations

import numpy as np

from ..masks import StepMask
from .drafts import GROUP_SOURCES
from .layout import (
    Columns,
    Layout,
    consecutive_positions,
    draft_rows,
    layout_mask,
    pad_drafts,
    right_aligned,
    rows_of,
    window_rows,
    with_group_rows,
)
from .plan import Plan
from .types import Row


class WindowStrategy:
    """Sliding window: feed what is not yet cached, then the masks. With `cached=False` nothing is
    kept and every step feeds the whole sequence; with `cached=True` the cache keeps committed tokens
    only. Where drafts are verified, a row's drafts sit between its real tokens and its masks, and
    up to `group_counts[name]` groups of each in-forward source follow."""

    def __init__(self, settings: Plan, cached: bool):
        self.s = settings
        self.cached = cached
        self._key_valid: np.ndarray | None = None  # (b, cache_len) for the cached variant (`key_valid`)
        # (b, cache_len) where every cached key is real and the array is not made until asked for.
        self._every: tuple[int, int] | None = None
        # Narrowed per step where the feed is measured (Execution.choose).
        self.masks = settings.masks_per_step
        # The most groups of each in-forward source a step feeds, by source name (drafts.GROUP_SOURCES).
        self.group_counts = {name: source.count(settings) for name, source in GROUP_SOURCES.items()}

    @property
    def key_valid(self) -> np.ndarray | None:
        """(b, cache_len) which cached keys are real (the cached variant; None before its first step)."""
        if self._every is not None:
            self._key_valid, self._every = np.ones(self._every, dtype=bool), None
        return self._key_valid

    @key_valid.setter
    def key_valid(self, value: np.ndarray | None) -> None:
        self._key_valid, self._every = value, None

    def lay_out(self, rows: list[Row]) -> Layout:
        s, m = self.s, self.masks
        # Lossless: as many drafts as leave room for the AR token after them.
        drafts = [[] if r.done else r.drafts[: r.max_tokens - r.produced - 1] for r in rows]
        parts = [[] if r.done else r.seq[r.cached :] + d for r, d in zip(rows, drafts)]
        width = max(len(p) for p in parts) + m
        ids, valid, positions = window_rows(  # lists of rows: arrays once the groups are laid out
            parts, width, s.mask_id, [0 if r.done else m for r in rows], [r.cached for r in rows]
        )
        padded, n = draft_rows(drafts, s.mask_id)
        groups = in_forward_groups(s, self.group_counts, rows, n, m)
        # Right-aligned: every row's masks start at width - m, its drafts just before them.
        columns = Columns(
            last=[width - m - 1 - k for k in n],
            n_drafts=n,
            draft_slots=max(n, default=0),
            masks=m,
            width=width,
            keep=width - m,
            groups=groups,
        )
        # Holes: a row feeding fewer columns than the widest, or a group not live in a row.
        holes = not all(map(all, valid)) or not all(all(g.lists("live")) for g in groups)
        # The layout's values stay lists (the host reads them so); arrays are made where asked for.
        if not s.verifies:
            limit = [0 if r.done else min(m + 1, r.max_tokens - r.produced) for r in rows]
            return Layout(ids, positions, valid, limit, columns, holes=holes)
        limit = [0 if r.done else k + 1 for r, k in zip(rows, n)]
        layout = verified_layout(ids, positions, valid, limit, columns, padded, s.mask_id)
        layout.holes = holes
        return layout

    def keep_rows(self, keep: list[int]) -> None:
        if self.key_valid is not None:
            self.key_valid = self.key_valid[keep]

    def add_row(self, row: Row) -> None:
        """A row joins the batch: the keys cached so far are holes to it; its first step feeds its prompt."""
        if self.key_valid is not None:
            self.key_valid = np.concatenate([self.key_valid, np.zeros((1, self.key_valid.shape[1]), dtype=bool)])

    def keys(self, layout: Layout) -> np.ndarray:
        if not self.cached or self.key_valid is None:
            return layout.valid
        return joined_keys(self.key_valid, layout)

    def mask(self, layout: Layout) -> StepMask | None:
        """The step's attention mask, `layout_mask` over `keys`: decided without the keys where every
        cached key and every fed column is real (most steps of a row alone)."""
        if layout.holes is False and (not self.cached or self._every is not None or self._key_valid is None):
            cached = self._every[1] if self.cached and self._every is not None else 0
            see = layout.lists("see")
            return None if see is None else StepMask(cached, layout.width, None, see, layout.lists("start"))
        return layout_mask(self.keys(layout), layout)

    def commit(
        self, backend, cache, rows: list[Row], layout: Layout, before: list[int], kept: list[int] | None = None
    ) -> None:
        """Keep what the step fed for real (`kept`, lossless: the drafts each row kept)."""
        if not self.cached:
            return
        # Keep the real tokens just fed; the masks' keys were computed from MASK and go.
        columns = layout.columns
        if len(rows) == 1 and not rows[0].done and self._key_valid is None:
            # A row alone feeds no holes and every key it cached is real: so is every key it keeps, its
            # real tokens and the drafts it kept (the rejected ones end its columns: they go).
            old = 0 if self._every is None else self._every[1]
            end = old + (columns.keep if kept is None else columns.lists("last")[0] + 1 + kept[0])
            self._every = (1, end)
            backend.crop(cache, end)
            rows[0].cached = before[0]
            return
        old = 0 if self.key_valid is None else self.key_valid.shape[1]
        self.key_valid = self.keys(layout)[:, : old + columns.keep].copy()
        if kept is not None:  # rejected drafts were computed from wrong ids: make them holes
            for r, (k, last, n) in enumerate(zip(kept, columns.lists("last"), columns.lists("n_drafts"))):
                self.key_valid[r, old + last + 1 + k : old + last + 1 + n] = False
            # Rows are right-aligned, so rejected drafts end every row's columns: the tail no
            # row attends leaves the cache at once (at batch 1, every rejected draft).
            live = self.key_valid[:, old:].any(axis=0).tolist()
            end = old + max((j + 1 for j, used in enumerate(live) if used), default=0)
            self.key_valid = self.key_valid[:, :end]
        backend.crop(cache, self.key_valid.shape[1])
        for r, b in zip(rows, before):
            r.cached = b


class BlockStrategy:
    """Block-level cache for batches: rows stay aligned on blocks of B_cache tokens, each step feeding
    the block's slots (filled ones real, the rest masks) on the block-start cache; a row that filled
    its block waits. A finished block (or the prompt) is fed in front of the next block's first step,
    so no forward only commits."""

    def __init__(self, settings: Plan, rows: list[Row] = ()):
        self.s = settings
        self.masks = settings.masks_per_step  # a served batch sets it per step from its rows' thresholds
        self.key_valid: np.ndarray | None = None
        # In-forward sources whose groups the block's steps feed (tree nodes; spare and runner-up groups
        # run on the window cache): the most groups of each, by source name.
        self.group_counts = {name: source.count(settings) for name, source in GROUP_SOURCES.items()}
        self.block_start: list[int] = [len(r.seq) for r in rows]  # len(seq) at the start of each row's block

    def lay_out(self, rows: list[Row]) -> Layout:
        s, size = self.s, self.s.block_cache
        fold = [r.seq[r.cached : start] if not r.done else [] for r, start in zip(rows, self.block_start)]
        width_fold = max(len(f) for f in fold)
        fold_ids, fold_valid = right_aligned(fold, width_fold, s.mask_id, [0] * len(rows))
        fill = [len(r.seq) - start for r, start in zip(rows, self.block_start)]
        waiting = [r.done or f >= size for r, f in zip(rows, fill)]
        room = [min(size - f, r.max_tokens - r.produced) for r, f in zip(rows, fill)]
        # Lossless: drafts fill the slots after the row's real ones, leaving room for the AR token.
        drafts = [[] if w or not s.verifies else r.drafts[: k - 1] for r, w, k in zip(rows, waiting, room)]
        blk_ids = np.full((len(rows), size), s.mask_id, dtype=np.int64)
        blk_valid = np.zeros((len(rows), size), dtype=bool)
        for i, (r, start, f, d) in enumerate(zip(rows, self.block_start, fill, drafts)):
            if not waiting[i]:
                blk_ids[i, :f] = r.seq[start:]
                blk_ids[i, f : f + len(d)] = d
                blk_valid[i] = True
        ids = np.concatenate([fold_ids, blk_ids], axis=1)
        valid = np.concatenate([fold_valid, blk_valid], axis=1)
        positions = consecutive_positions(valid, [r.cached for r in rows])
        padded, n = pad_drafts(drafts, s.mask_id)
        # The cache keeps the fold (the last block or the prompt) and only that.
        last = width_fold + np.asarray(fill, dtype=np.int64) - 1
        groups = in_forward_groups(s, self.group_counts, rows, n, self.masks)
        columns = Columns(
            last=last,
            n_drafts=n,
            draft_slots=padded.shape[1],
            masks=self.masks,
            width=ids.shape[1],
            keep=width_fold,
            groups=groups,
        )
        if s.verifies:
            limit = np.asarray([0 if w else k + 1 for w, k in zip(waiting, n)])
            # Any groups follow the block; a group sees the fold and the block up to its anchor.
            return verified_layout(ids, positions, valid, limit, columns, padded, s.mask_id)
        limit = [0 if w else min(self.masks + 1, k) for w, k in zip(waiting, room)]
        return Layout(ids, positions, valid, np.asarray(limit), columns)

    def keep_rows(self, keep: list[int]) -> None:
        if self.key_valid is not None:
            self.key_valid = self.key_valid[keep]
        if self.block_start:
            self.block_start = [self.block_start[j] for j in keep]

    def add_row(self, row: Row) -> None:
        """A row joins at a block boundary: the cached keys are holes to it; its first block follows its prompt."""
        self.block_start.append(len(row.seq))
        if self.key_valid is not None:
            self.key_valid = np.concatenate([self.key_valid, np.zeros((1, self.key_valid.shape[1]), dtype=bool)])

    def next_block_if_filled(self, rows: list[Row]) -> None:
        """Once every row filled (or finished) its block, the next step commits it and starts the next."""
        size = self.s.block_cache
        if self.block_start and all(r.done or len(r.seq) - start >= size for r, start in zip(rows, self.block_start)):
            self.block_start = [len(r.seq) for r in rows]

    def keys(self, layout: Layout) -> np.ndarray:
        if self.key_valid is None:
            return layout.valid
        return joined_keys(self.key_valid, layout)

    def mask(self, layout: Layout) -> StepMask | None:
        """The step's attention mask: `layout_mask` over `keys`."""
        return layout_mask(self.keys(layout), layout)

    def commit(
        self, backend, cache, rows: list[Row], layout: Layout, before: list[int], kept: list[int] | None = None
    ) -> None:
        old = 0 if self.key_valid is None else self.key_valid.shape[1]
        self.key_valid = self.keys(layout)[:, : old + layout.columns.keep]
        backend.crop(cache, self.key_valid.shape[1])
        for r, start in zip(rows, self.block_start):
            if not r.done:
                r.cached = start
        self.next_block_if_filled(rows)


def in_forward_groups(s: Plan, counts: dict[str, int], rows: list[Row], n_drafts, masks: int) -> tuple:
    """The groups a step that verifies drafts feeds after its columns: up to `counts[name]` of each
    in-forward source (drafts.GROUP_SOURCES), each with `masks` masks; none where drafts are not verified.
    `n_drafts`: per row, the drafts it feeds (a list, or an array), handed to the sources as a list."""
    if not s.verifies:
        return ()
    n_drafts = rows_of(n_drafts)
    return tuple(
        g
        for name, source in GROUP_SOURCES.items()
        if counts.get(name)
        for g in source.groups(rows, n_drafts, counts[name], masks, s.mask_id)
    )


def verified_layout(ids, positions, valid, limit, columns: Columns, drafts, mask_id: int) -> Layout:
    """A step that verifies `drafts`, widened by `columns.groups` where it has any (`with_group_rows`);
    `ids`, `positions` and `valid`: (b, w) arrays, or lists of rows (the layout keeps what it is given,
    the groups' widening as lists)."""
    if not columns.groups:
        return Layout(ids, positions, valid, limit, columns, drafts=drafts)
    ids, valid, positions, see, start = with_group_rows(ids, valid, positions, columns, mask_id)
    return Layout(ids, positions, valid, limit, columns, drafts=drafts, see=see, start=start)


def joined_keys(key_valid: np.ndarray, layout: Layout) -> np.ndarray:
    """(b, C + q) the keys a step's queries may see, cached then fed; made once a step, kept on the layout."""
    if layout.keys is None:
        layout.keys = np.concatenate([key_valid, layout.valid], axis=1)
    return layout.keys


def make_strategy(settings: Plan, rows: list[Row]):
    """The strategy `settings.cache` names, for these rows."""
    if settings.cache == "block":
        return BlockStrategy(settings, rows)
    return WindowStrategy(settings, cached=settings.cache == "window")
