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
        """(b, k) the column each output slot is read at (inside the feed even for a row feeding nothing).
        Built row by row in plain Python, one array at the end: a step's few values cost less so than
        a dozen array operations (docs/design.md, "One step")."""
        top, d, m = self.width - 1, self.draft_slots, self.masks
        groups = list(range(self.width, self.total))  # every group column, each read
        rows = []
        for last, n in zip(self.last.tolist(), self.n_drafts.tolist()):
            first = last + 1 + n
            rows.append(
                [min(max(last + (j if j < n else n), 0), top) for j in range(d + 1)]
                + [min(max(first + j, 0), top) for j in range(m)]
                + groups
            )
        return np.array(rows, dtype=np.int64).reshape(len(rows), d + 1 + m + len(groups))


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
    # Whether any fed column is a hole (None: not known; `valid` says): with none, a step's mask needs
    # no keys where every cached key is real (WindowStrategy.mask).
    holes: bool | None = None

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
        groups = [g.live.tolist() for g in self.columns.groups if g.source == source]
        return np.array([sum(row) for row in zip(*groups)], dtype=np.int64) if groups else None


def lossless_width(drafts: int, masks: int, spare_groups: int, alt_groups: int = 0) -> int:
    """Columns a row feeds in a lossless window step with its cache up to date: the token the last
    step took, its drafts, the masks, and its spare and alternative groups."""
    return 1 + drafts + masks + min(spare_groups, drafts) * masks + (alt_groups * (1 + masks) if drafts else 0)


def with_groups(ids, valid, positions, columns: Columns, mask_id: int):
    """A lossless window feed (ids, valid, positions: (b, w) arrays, or lists of rows) widened by
    `columns.groups`: the new (ids, valid, positions) and, per fed column, what it sees (`see`,
    `start`: masks.StepMask). A live group sits, by position and by what it sees, as a plain window
    continuing after its anchor would: the chain up to its anchor, then its own columns; elsewhere
    its columns are holes. Built in plain Python, one array per output."""
    ids, valid, fed_positions = (a.tolist() if isinstance(a, np.ndarray) else a for a in (ids, valid, positions))
    b, w0 = len(ids), len(ids[0]) if ids else 0
    width = columns.total
    more = width - w0
    wide_ids = [row + [mask_id] * more for row in ids]
    wide_valid = [row + [False] * more for row in valid]
    wide_positions = [row + [0] * more for row in fed_positions]
    see = [list(range(width)) for _ in range(b)]
    start = [list(range(width)) for _ in range(b)]
    lasts = columns.last.tolist()
    for k, group in enumerate(columns.groups):
        first = columns.width + columns.group_start(k)  # a group's columns lie together
        w, p = group.width, group.prefix.shape[1]
        end = first + w
        for r, (live, anchor, prefix) in enumerate(
            zip(group.live.tolist(), group.anchor.tolist(), group.prefix.tolist())
        ):
            anchor += lasts[r]  # the column the group follows
            if live:
                wide_ids[r][first : first + p] = prefix
                wide_valid[r][first:end] = [True] * w
                after = fed_positions[r][anchor] + 1
                wide_positions[r][first:end] = range(after, after + w)
            see[r][first:end] = [anchor] * w
            start[r][first:end] = [first] * w
    shape = (b, width)
    return (
        np.array(wide_ids, dtype=np.int64).reshape(shape),
        np.array(wide_valid, dtype=bool).reshape(shape),
        np.array(wide_positions, dtype=np.int64).reshape(shape),
        np.array(see, dtype=np.int64).reshape(shape),
        np.array(start, dtype=np.int64).reshape(shape),
    )


def window_rows(parts: list[list[int]], width: int, mask_id: int, n_masks: list[int], first: list[int]):
    """`window_feed` as lists of rows, for a caller that builds on them (`with_groups`)."""
    ids, valid, positions = [], [], []
    for toks, m, at in zip(parts, n_masks, first):
        fed = len(toks) + m
        holes = width - fed
        ids.append([mask_id] * holes + list(toks) + [mask_id] * m)
        valid.append([False] * holes + [True] * fed)
        positions.append([0] * holes + list(range(at, at + fed)))
    return ids, valid, positions


def window_feed(parts: list[list[int]], width: int, mask_id: int, n_masks: list[int], first: list[int]):
    """Rows laid out right-aligned, [holes][tokens][masks], their positions consecutive over the
    tokens and masks from first[r] (holes at 0): ids, valid, positions, built in plain Python."""
    return feed_arrays(*window_rows(parts, width, mask_id, n_masks, first))


def feed_arrays(ids, valid, positions):
    """A feed's (b, w) arrays of ids, valid and positions, from arrays or lists of rows."""
    shape = (len(ids), len(ids[0]) if len(ids) else 0)
    return (
        np.asarray(ids, dtype=np.int64).reshape(shape),
        np.asarray(valid, dtype=bool).reshape(shape),
        np.asarray(positions, dtype=np.int64).reshape(shape),
    )


def right_aligned(parts: list[list[int]], width: int, mask_id: int, n_masks: list[int]):
    """Lay rows out right-aligned: [holes][tokens][masks]; returns ids, valid."""
    return window_feed(parts, width, mask_id, n_masks, [0] * len(parts))[:2]


def pad_drafts(drafts: list[list[int]], mask_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(b, D) the rows' drafts padded with the mask id, and (b,) how many each row has."""
    width = max((len(d) for d in drafts), default=0)
    out = [list(d) + [mask_id] * (width - len(d)) for d in drafts]
    n = [len(d) for d in drafts]
    return np.array(out, dtype=np.int64).reshape(len(drafts), width), np.array(n, dtype=np.int64)


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
