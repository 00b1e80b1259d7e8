"""The cache strategies (docs/method.md §5-6): what each row feeds on top of its committed
cache, and what the cache keeps after the step.

`WindowStrategy` feeds what is not yet cached, then the masks (with the window cache or
none); `BlockStrategy` feeds the current block's slots on the block-start cache, with the
last block (or the prompt) folded in front. Both describe their feed with `Columns`."""

from __future__ import annotations

import numpy as np

from .types import Row
from .plan import DecodeSettings
from .layout import Columns, Feed, consecutive_positions, pad_drafts, right_aligned


class WindowStrategy:
    """Sliding window (docs/method.md §5-6): feed what is not yet cached, then B masks.

    With `cached=False` nothing is kept: every step feeds the whole sequence.
    With `cached=True` the cache keeps committed tokens only; mask entries are cropped.
    Lossless mode feeds each row's drafts between its real tokens and its masks, and greedy
    lossless mode up to `spare_groups` spare groups after all of them, then up to
    `alt_groups` alternative groups (a runner-up for the first draft, then the masks).
    """

    def __init__(self, settings: DecodeSettings, cached: bool):
        self.s = settings
        self.cached = cached
        self.key_valid: np.ndarray | None = None  # (b, cache_len) for the cached variant
        # Per step, a cost-aware loop may narrow these (FeedPolicy); lossless output stays AR's.
        self.masks = settings.masks_per_step
        self.spare_groups = settings.spare_groups
        self.alt_groups = settings.alternative_groups

    def plan(self, rows: list[Row]) -> Feed:
        s, m = self.s, self.masks
        # Lossless: as many drafts as leave room for the AR token after them.
        drafts = [[] if r.done else r.drafts[: r.max_tokens - r.produced - 1] for r in rows]
        parts = [[] if r.done else r.seq[r.cached :] + d for r, d in zip(rows, drafts)]
        width = max(len(p) for p in parts) + m
        ids, valid = right_aligned(parts, width, s.mask_id, [0 if r.done else m for r in rows])
        positions = consecutive_positions(valid, [r.cached for r in rows])
        padded, n = pad_drafts(drafts, s.mask_id)
        # A spare group follows a draft: no more of them than the most drafts any row feeds.
        spare = min(self.spare_groups, int(n.max(initial=0))) if s.verifies and m else 0
        # Runners-up for the first draft: only a row that feeds a draft has one to replace.
        alts = [r.alts[: self.alt_groups] if d and s.verifies else [] for r, d in zip(rows, drafts)]
        alt_ids, n_alts = pad_drafts(alts, s.mask_id)
        # Right-aligned: every row's masks start at width - m, its drafts just before them.
        columns = Columns(last=width - m - 1 - n, n_drafts=n, draft_slots=padded.shape[1], masks=m, width=width, keep=width - m,
                          spare_groups=spare, alt_groups=alt_ids.shape[1])
        if not s.verifies:
            limit = [0 if r.done else min(m + 1, r.max_tokens - r.produced) for r in rows]
            return Feed(ids, positions, valid, np.asarray(limit), columns)
        limit = np.asarray([0 if r.done else k + 1 for r, k in zip(rows, n)])
        if not (spare or columns.alt_groups):
            return Feed(ids, positions, valid, limit, columns, drafts=padded)
        ids, valid, positions, attend = _with_groups(ids, valid, positions, columns, [r.done for r in rows], s.mask_id, alt_ids, n_alts)
        feed = Feed(ids, positions, valid, limit, columns, drafts=padded, attend=attend)
        if columns.alt_groups:
            feed.alts, feed.n_alts = alt_ids, n_alts
        return feed

    def keep_rows(self, keep: list[int]) -> None:
        if self.key_valid is not None:
            self.key_valid = self.key_valid[keep]

    def add_row(self, row: Row) -> None:
        """A row joins the batch (ContinuousBatch): the keys cached so far are holes to it; its
        first step feeds its whole prompt (`row.cached` is 0)."""
        if self.key_valid is not None:
            self.key_valid = np.concatenate([self.key_valid, np.zeros((1, self.key_valid.shape[1]), dtype=bool)])

    def keys(self, feed: Feed) -> np.ndarray:
        if not self.cached or self.key_valid is None:
            return feed.valid
        return np.concatenate([self.key_valid, feed.valid], axis=1)

    def commit(self, backend, cache, rows: list[Row], feed: Feed, before: list[int], kept: np.ndarray | None = None) -> None:
        """Keep what the step fed for real (`kept`, lossless: the drafts each row kept)."""
        if not self.cached:
            return
        # Keep the real tokens just fed; the masks' keys were computed from MASK and go.
        columns = feed.columns
        old = 0 if self.key_valid is None else self.key_valid.shape[1]
        self.key_valid = self.keys(feed)[:, : old + columns.keep].copy()
        if kept is not None:  # rejected drafts were computed from wrong ids: make them holes
            for r, k in enumerate(kept):
                self.key_valid[r, old + columns.last[r] + 1 + k : old + columns.first_mask[r]] = False
            # Rows are right-aligned, so rejected drafts end every row's columns: the tail no
            # row attends leaves the cache at once (at batch 1, every rejected draft).
            live = self.key_valid[:, old:].any(axis=0)
            end = old + (int(np.flatnonzero(live)[-1]) + 1 if live.any() else 0)
            self.key_valid = self.key_valid[:, :end]
        backend.crop(cache, self.key_valid.shape[1])
        for r, b in zip(rows, before):
            r.cached = b


def _with_groups(ids, valid, positions, columns: Columns, done: list[bool], mask_id: int, alts=None, n_alts=None):
    """A lossless window feed widened by `columns.spare_groups` spare groups of masks and
    `columns.alt_groups` alternative groups: the new (ids, valid, positions) and `attend`,
    which fed columns each fed query may see.

    Spare group g of a row that fed more than g drafts sits, by position and by what it
    attends to, right after its g-th draft (g = 0: after the last verified token): each of
    its masks sees the fed columns up to that token and the group's masks before it, as the
    masks of a plain window ending there would. Alternative group k of a row with more than
    k runners-up (`alts`, `n_alts`) is its k-th runner-up at its first draft's position, then
    masks, seeing the fed columns up to the last verified token and the group before it: a
    plain window ending at the runner-up. Other rows' group columns are holes."""
    b, w0 = ids.shape
    width, masks = columns.total, columns.masks
    wide_ids = np.full((b, width), mask_id, dtype=np.int64)
    wide_ids[:, :w0] = ids
    wide_valid = np.zeros((b, width), dtype=bool)
    wide_valid[:, :w0] = valid
    wide_positions = np.zeros((b, width), dtype=np.int64)
    wide_positions[:, :w0] = positions
    attend = np.broadcast_to(np.tril(np.ones((width, width), dtype=bool)), (b, width, width)).copy()
    attend[:, w0:, :] = False
    rows, running = np.arange(b), ~np.asarray(done, dtype=bool)
    for g in range(columns.spare_groups):
        cols = columns.spare_columns(g)
        live = (g < columns.n_drafts) & running
        wide_valid[:, cols] = live[:, None]
        anchor = columns.last + g  # the column the group follows
        wide_positions[:, cols] = np.where(live[:, None], positions[rows, anchor][:, None] + 1 + np.arange(masks)[None, :], 0)
        upto = np.arange(w0)[None, :] <= anchor[:, None]  # (b, w0): fed columns the group sees
        attend[:, cols, :w0] = upto[:, None, :]
        attend[:, cols[:, None], cols[None, :]] = np.tril(np.ones((masks, masks), dtype=bool))[None]
    upto = np.arange(w0)[None, :] <= columns.last[:, None]  # the verified tokens and what the cache holds
    for k in range(columns.alt_groups):
        cols = columns.alt_columns(k)
        live = (k < n_alts) & running
        wide_ids[:, cols[0]] = np.where(live, alts[:, k], mask_id)
        wide_valid[:, cols] = live[:, None]
        wide_positions[:, cols] = np.where(live[:, None], positions[rows, columns.last][:, None] + 1 + np.arange(1 + masks)[None, :], 0)
        attend[:, cols, :w0] = upto[:, None, :]
        attend[:, cols[:, None], cols[None, :]] = np.tril(np.ones((1 + masks, 1 + masks), dtype=bool))[None]
    return wide_ids, wide_valid, wide_positions, attend


class BlockStrategy:
    """Block-level cache for batches (docs/method.md §6).

    Rows stay aligned on blocks of B_cache generated tokens. Inside a block every
    step feeds the block's slots (filled ones real, the rest masks) on the
    block-start cache; a row that filled its block waits. The finished block is
    committed by feeding it in front of the next block's first step, and the
    prompt in front of the first block's, so no forward is spent on commits alone.
    """

    def __init__(self, settings: DecodeSettings, rows: list[Row] = ()):
        self.s = settings
        self.masks = settings.masks_per_step  # a served batch sets it per step from its rows' thresholds
        self.key_valid: np.ndarray | None = None
        self.block_start: list[int] = [len(r.seq) for r in rows]  # len(seq) at the start of each row's block

    def plan(self, rows: list[Row]) -> Feed:
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
        columns = Columns(last=last, n_drafts=n, draft_slots=padded.shape[1], masks=self.masks, width=ids.shape[1], keep=width_fold)
        if s.verifies:
            limit = np.asarray([0 if w else k + 1 for w, k in zip(waiting, n)])
            return Feed(ids, positions, valid, limit, columns, drafts=padded)
        limit = [0 if w else min(self.masks + 1, k) for w, k in zip(waiting, room)]
        return Feed(ids, positions, valid, np.asarray(limit), columns)

    def keep_rows(self, keep: list[int]) -> None:
        if self.key_valid is not None:
            self.key_valid = self.key_valid[keep]
        if self.block_start:
            self.block_start = [self.block_start[j] for j in keep]

    def add_row(self, row: Row) -> None:
        """A row joins the batch at a block boundary (ContinuousBatch): the keys cached so far
        are holes to it, and its first block starts where its prompt ends."""
        self.block_start.append(len(row.seq))
        if self.key_valid is not None:
            self.key_valid = np.concatenate([self.key_valid, np.zeros((1, self.key_valid.shape[1]), dtype=bool)])

    def next_block_if_filled(self, rows: list[Row]) -> None:
        """Once every row filled (or finished) its block, the next step commits it and starts the next."""
        size = self.s.block_cache
        if self.block_start and all(r.done or len(r.seq) - start >= size for r, start in zip(rows, self.block_start)):
            self.block_start = [len(r.seq) for r in rows]

    def keys(self, feed: Feed) -> np.ndarray:
        if self.key_valid is None:
            return feed.valid
        return np.concatenate([self.key_valid, feed.valid], axis=1)

    def commit(self, backend, cache, rows: list[Row], feed: Feed, before: list[int], kept: np.ndarray | None = None) -> None:
        old = 0 if self.key_valid is None else self.key_valid.shape[1]
        self.key_valid = self.keys(feed)[:, : old + feed.columns.keep]
        backend.crop(cache, self.key_valid.shape[1])
        for r, start in zip(rows, self.block_start):
            if not r.done:
                r.cached = start
        self.next_block_if_filled(rows)


def make_strategy(settings: DecodeSettings, rows: list[Row]):
    """The strategy `settings.cache` names, for these rows."""
    if settings.cache == "block":
        return BlockStrategy(settings, rows)
    return WindowStrategy(settings, cached=settings.cache == "window")
