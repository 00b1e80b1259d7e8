"""What one step feeds (docs/method.md §5, §6, §8): the fed arrays, the attention mask, and `Columns`,
the one description of where each part of a row sits (in order: holes, its real tokens, its drafts,
its masks, then any groups) that the reads, the acceptance, the groups and the commit all use."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..masks import StepMask


@dataclass(frozen=True)
class Group:
    """The columns an in-forward draft source adds to a lossless window step: placed after row r's
    first `anchor[r]` drafts, seeing what a plain window ending there would, it feeds `prefix[r]` (real
    ids, e.g. a runner-up), then `masks` masks, which propose. Rows where `live[r]` is False get holes."""

    source: str  # the draft source its proposals count under
    anchor: np.ndarray  # (b,) int64: drafts before it
    prefix: np.ndarray  # (b, p) int64: real ids it feeds before its masks
    live: np.ndarray  # (b,) bool
    masks: int

    @property
    def width(self) -> int:
        return self.prefix.shape[1] + self.masks


@dataclass(frozen=True)
class Columns:
    """Where a step's parts sit among the fed columns: row r's last real token at `last[r]`, its
    `n_drafts[r]` drafts, its masks, within the first `width` columns, then the `groups`; the cache
    keeps the first `keep` (rejected drafts aside). Output slots (`read`): 1 + D AR reads (at `last`,
    then each draft, a row with fewer repeating its last), the masks', then every group column."""

    last: np.ndarray  # (b,) int64
    n_drafts: np.ndarray  # (b,) int64; zeros outside lossless mode
    draft_slots: int  # D: the drafts' padded width (0 outside lossless mode)
    masks: int
    width: int  # fed columns before the groups
    keep: int  # leading fed columns the cache keeps after the step
    groups: tuple[Group, ...] = ()

    @property
    def first_mask(self) -> np.ndarray:
        """(b,) the column of each row's first mask, right after its drafts."""
        return self.last + 1 + self.n_drafts

    @property
    def total(self) -> int:
        """Every fed column, the groups' included."""
        return self.width + sum(g.width for g in self.groups)

    def group_start(self, index: int) -> int:
        """Offset of group `index`'s first column past `width` (and of its first read past the masks')."""
        return sum(g.width for g in self.groups[:index])

    def group_columns(self, index: int) -> np.ndarray:
        """The fed columns of group `index` (the same for every row)."""
        return self.width + self.group_start(index) + np.arange(self.groups[index].width)

    def group_reads(self, index: int) -> slice:
        """The output slots of group `index`: its prefix's, then its masks'."""
        start = self.draft_slots + 1 + self.masks + self.group_start(index)
        return slice(start, start + self.groups[index].width)

    def count(self, source: str) -> int:
        return sum(g.source == source for g in self.groups)

    def reads(self, source: str) -> slice:
        """The output slots of a source's groups, which sit together."""
        indices = [i for i, g in enumerate(self.groups) if g.source == source]
        if not indices:
            start = self.draft_slots + 1 + self.masks + self.group_start(len(self.groups))
            return slice(start, start)
        return slice(self.group_reads(indices[0]).start, self.group_reads(indices[-1]).stop)

    @property
    def ar_reads(self) -> slice:
        return slice(0, self.draft_slots + 1)

    @property
    def mask_reads(self) -> slice:
        return slice(self.draft_slots + 1, self.draft_slots + 1 + self.masks)

    def read(self) -> np.ndarray:
        """(b, k) the column each output slot is read at (inside the feed even for a row feeding nothing)."""
        top = self.width - 1
        ar = self.last[:, None] + np.minimum(np.arange(self.draft_slots + 1)[None, :], self.n_drafts[:, None])
        mk = np.minimum(self.first_mask[:, None] + np.arange(self.masks)[None, :], top)
        read = np.clip(np.concatenate([ar, mk], axis=1), 0, top)
        extra = self.total - self.width
        if not extra:
            return read
        groups = self.width + np.arange(extra)  # every group column, each read
        return np.concatenate([read, np.broadcast_to(groups, (len(read), groups.size))], axis=1)


@dataclass
class Layout:
    ids: np.ndarray  # (b, q) int64
    positions: np.ndarray  # (b, q) int64
    valid: np.ndarray  # (b, q) bool: False for holes
    limit: np.ndarray  # (b,) tokens row r may accept this step; 0 = it waits
    columns: Columns  # where each row's parts sit; slot j of row r is read at read[r, j]
    # Lossless mode: the drafts fed (b, D), padded, of which row r fed n_drafts[r].
    drafts: np.ndarray | None = None
    # With groups: (b, q) per fed column, the last column of the chain it sees and the first of its
    # own block (masks.StepMask's `see` and `start`).
    see: np.ndarray | None = None
    start: np.ndarray | None = None
    # (b, C + q) the cached keys' validity, then the fed columns' (the strategy's `keys`, made once).
    keys: np.ndarray | None = None

    @cached_property
    def read(self) -> np.ndarray:
        return self.columns.read()

    @property
    def n_drafts(self) -> np.ndarray | None:
        """Lossless mode: (b,) drafts each row fed (None otherwise)."""
        return None if self.drafts is None else self.columns.n_drafts

    @property
    def masks(self) -> int:
        """Masks fed and read per (live) row, the spare groups' not counted."""
        return self.columns.masks

    def live_groups(self, source: str) -> np.ndarray | None:
        """(b,) the groups of `source` each row fed live (None where the step fed none)."""
        groups = [g for g in self.columns.groups if g.source == source]
        return np.sum([g.live for g in groups], axis=0).astype(np.int64) if groups else None


def lossless_width(drafts: int, masks: int, spare_groups: int, alt_groups: int = 0) -> int:
    """Columns a row feeds in a lossless window step with its cache up to date: the token the last
    step took, its drafts, the masks, and its spare and alternative groups."""
    return 1 + drafts + masks + min(spare_groups, drafts) * masks + (alt_groups * (1 + masks) if drafts else 0)


def with_groups(ids, valid, positions, columns: Columns, mask_id: int):
    """A lossless window feed widened by `columns.groups`: the new (ids, valid, positions) and, per fed
    column, what it sees (`see`, `start`: masks.StepMask). A live group sits, by position and by what
    it sees, as a plain window continuing after its anchor would: the chain up to its anchor, then
    its own columns; elsewhere its columns are holes."""
    b, w0 = ids.shape
    width = columns.total
    wide_ids = np.full((b, width), mask_id, dtype=np.int64)
    wide_ids[:, :w0] = ids
    wide_valid = np.zeros((b, width), dtype=bool)
    wide_valid[:, :w0] = valid
    wide_positions = np.zeros((b, width), dtype=np.int64)
    wide_positions[:, :w0] = positions
    see = np.empty((b, width), dtype=np.int64)
    see[:] = np.arange(width)
    start = see.copy()
    rows = np.arange(b)
    for k, group in enumerate(columns.groups):
        first = columns.width + columns.group_start(k)  # a group's columns lie together: slices, not index arrays
        cols = slice(first, first + group.width)
        live = group.live
        p = group.prefix.shape[1]
        if p:
            wide_ids[:, first : first + p] = np.where(live[:, None], group.prefix, mask_id)
        wide_valid[:, cols] = live[:, None]
        anchor = columns.last + group.anchor  # the column the group follows
        wide_positions[:, cols] = np.where(
            live[:, None], positions[rows, anchor][:, None] + 1 + np.arange(group.width)[None, :], 0
        )
        see[:, cols] = anchor[:, None]
        start[:, cols] = first
    return wide_ids, wide_valid, wide_positions, see, start


def right_aligned(parts: list[list[int]], width: int, mask_id: int, n_masks: list[int]):
    """Lay rows out right-aligned: [holes][tokens][masks]; returns ids, valid."""
    batch = len(parts)
    ids = np.full((batch, width), mask_id, dtype=np.int64)
    valid = np.zeros((batch, width), dtype=bool)
    for r, (toks, m) in enumerate(zip(parts, n_masks)):
        start = width - len(toks) - m
        ids[r, start : start + len(toks)] = toks
        valid[r, start:] = True
    return ids, valid


def pad_drafts(drafts: list[list[int]], mask_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(b, D) the rows' drafts padded with the mask id, and (b,) how many each row has."""
    width = max((len(d) for d in drafts), default=0)
    out = np.full((len(drafts), width), mask_id, dtype=np.int64)
    for r, d in enumerate(drafts):
        out[r, : len(d)] = d
    return out, np.asarray([len(d) for d in drafts], dtype=np.int64)


def consecutive_positions(valid: np.ndarray, first: list[int]) -> np.ndarray:
    """Consecutive positions over each row's valid slots, starting at first[r]; holes get 0."""
    pos = np.cumsum(valid, axis=1) - 1 + np.asarray(first, dtype=np.int64)[:, None]
    return np.where(valid, pos, 0)


def layout_mask(keys: np.ndarray, layout: Layout) -> StepMask | None:
    """The attention mask of a step (masks.StepMask): causal over the cache and the fed columns, with
    holes, narrowed by the layout's `see` and `start` for the groups; None where plain causal
    attention is exact."""
    q = layout.ids.shape[1]
    every = bool(keys.all())
    if every and layout.see is None:
        return None
    return StepMask(keys.shape[1] - q, q, None if every else keys, layout.see, layout.start)
