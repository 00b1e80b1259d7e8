"""What one step feeds: the fed arrays, where each part of a row sits among the fed columns
(`Columns`), and the attention mask of the step (docs/method.md §5, §6, §8).

Every strategy lays a row out the same way, in column order: holes, the row's real tokens
ending at its last real token, its drafts (lossless), then masks; a lossless window step may
append spare groups of masks after all of that, and alternative groups (a runner-up for the
first draft, then masks) after those. `Columns` records where those parts sit, so
the reads, the acceptance, the spare groups and the commit all take their columns from one
description."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..masks import decode_mask


@dataclass(frozen=True)
class Columns:
    """Where a step's parts sit among the fed columns, per row.

    Row r's last real token is at column `last[r]`; its `n_drafts[r]` drafts follow it, then
    its masks, of which the first `masks` are read. The step's first `width` columns hold all
    that; `spare_groups` groups of `masks` masks each follow them (`spare_columns`), then
    `alt_groups` alternative groups of 1 + `masks` columns each (`alt_columns`: a runner-up
    for the first draft, then masks). After the step the cache keeps the first `keep` fed
    columns (rejected drafts aside).

    Each output slot of the step is read at one column (`read`): first the AR reads, 1 + D
    of them (the output at `last`, then at each draft; D the most drafts any row feeds, a row
    with fewer repeating its last read), then the masks', then the spare groups', then the
    alternative groups' (each: its runner-up's, then its masks').
    `ar_reads`, `mask_reads`, `spare_reads` and `alt_reads` say which output slots are which."""

    last: np.ndarray  # (b,) int64
    n_drafts: np.ndarray  # (b,) int64; zeros outside lossless mode
    draft_slots: int  # D: the drafts' padded width (0 outside lossless mode)
    masks: int
    width: int  # fed columns before the spare groups
    keep: int  # leading fed columns the cache keeps after the step
    spare_groups: int = 0
    alt_groups: int = 0

    @property
    def first_mask(self) -> np.ndarray:
        """(b,) the column of each row's first mask, right after its drafts."""
        return self.last + 1 + self.n_drafts

    @property
    def total(self) -> int:
        """Every fed column, the spare and alternative groups' included."""
        return self.width + self.spare_groups * self.masks + self.alt_groups * (1 + self.masks)

    def spare_columns(self, group: int) -> np.ndarray:
        """The fed columns of spare group `group` (the same for every row)."""
        return self.width + group * self.masks + np.arange(self.masks)

    def alt_columns(self, group: int) -> np.ndarray:
        """The fed columns of alternative group `group`: its runner-up, then its masks."""
        return self.width + self.spare_groups * self.masks + group * (1 + self.masks) + np.arange(1 + self.masks)

    @property
    def ar_reads(self) -> slice:
        return slice(0, self.draft_slots + 1)

    @property
    def mask_reads(self) -> slice:
        return slice(self.draft_slots + 1, self.draft_slots + 1 + self.masks)

    @property
    def spare_reads(self) -> slice:
        start = self.draft_slots + 1 + self.masks
        return slice(start, start + self.spare_groups * self.masks)

    @property
    def alt_reads(self) -> slice:
        start = self.draft_slots + 1 + self.masks + self.spare_groups * self.masks
        return slice(start, start + self.alt_groups * (1 + self.masks))

    def read(self) -> np.ndarray:
        """(b, k) the column each output slot is read at. A row that feeds nothing (finished,
        still in the batch) reads inside the feed all the same: its reads are ignored but
        must exist."""
        top = self.width - 1
        ar = self.last[:, None] + np.minimum(np.arange(self.draft_slots + 1)[None, :], self.n_drafts[:, None])
        mk = np.minimum(self.first_mask[:, None] + np.arange(self.masks)[None, :], top)
        read = np.clip(np.concatenate([ar, mk], axis=1), 0, top)
        extra = self.total - self.width
        if not extra:
            return read
        groups = self.width + np.arange(extra)  # spare groups', then alternative groups' columns, each read
        return np.concatenate([read, np.broadcast_to(groups, (len(read), groups.size))], axis=1)


@dataclass
class Feed:
    ids: np.ndarray  # (b, q) int64
    positions: np.ndarray  # (b, q) int64
    valid: np.ndarray  # (b, q) bool: False for holes
    limit: np.ndarray  # (b,) tokens row r may accept this step; 0 = it waits
    columns: Columns  # where each row's parts sit; slot j of row r is read at read[r, j]
    # Lossless mode: the drafts fed (b, D), padded, of which row r fed n_drafts[r].
    drafts: np.ndarray | None = None
    # With spare or alternative groups: (b, q, q), which fed columns each fed query may see.
    attend: np.ndarray | None = None
    # With alternative groups: (b, A) the runners-up fed, padded, of which row r fed n_alts[r].
    alts: np.ndarray | None = None
    n_alts: np.ndarray | None = None

    @cached_property
    def read(self) -> np.ndarray:
        """(b, k) indices into the fed columns: slot j of row r is read at read[r, j]."""
        return self.columns.read()

    @property
    def n_drafts(self) -> np.ndarray | None:
        """Lossless mode: (b,) drafts each row fed (None otherwise)."""
        return None if self.drafts is None else self.columns.n_drafts

    @property
    def masks(self) -> int:
        """Masks fed and read per (live) row, the spare groups' not counted."""
        return self.columns.masks

    @property
    def spare_groups(self) -> int:
        return self.columns.spare_groups


def lossless_width(drafts: int, masks: int, spare_groups: int, alt_groups: int = 0) -> int:
    """Columns a row feeds in a lossless window step with its cache up to date: the token the
    last step took, its drafts, the masks, a spare group after each of the first drafts, and
    alternative groups (1 + masks each) when it has a draft."""
    return 1 + drafts + masks + min(spare_groups, drafts) * masks + (alt_groups * (1 + masks) if drafts else 0)


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


def feed_mask(keys: np.ndarray, feed: Feed) -> np.ndarray | None:
    """The attention mask of a step: causal over the cache and the fed columns, with holes
    (None when plain causal attention is exact), narrowed by `feed.attend` where spare
    groups must see only what precedes them."""
    q = feed.ids.shape[1]
    if keys.all() and feed.attend is None:
        return None
    mask = decode_mask(keys, q)
    if feed.attend is not None:  # its diagonal is set, so a hole still sees itself
        mask[:, :, -q:] &= feed.attend
    return mask
