"""What one step feeds (docs/method.md §5, §6, §8): the fed arrays, the attention mask, and `Columns`,
the one description of where each part of a row sits (in order: holes, its real tokens, its drafts,
its masks, then any groups) that the reads, the acceptance, the groups and the commit all use."""

from __future__ import annotations

import numpy as np

from ..masks import StepMask


def rows_of(a) -> list:
    """A step's (b, w) or (b,) host value as plain lists: an array's `tolist`, lists as they are."""
    return a.tolist() if isinstance(a, np.ndarray) else a


class _Field:
    """A step's (b, w) or (b,) value, given as an array or as plain lists (of rows): read as an array
    (made once from the lists where it was given so), or through `lists` as lists (made once from the
    array where it was given so). A step's host side reads lists and the backend may too; the array is
    made only where something asks for it."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        arrays = obj._arrays
        found = arrays.get(self.name)
        if found is None:
            rows = obj._lists.get(self.name)
            if rows is None:
                return None
            found = arrays[self.name] = np.array(rows, dtype=self.dtype)
        return found

    def __set__(self, obj, value):
        if value is None or isinstance(value, np.ndarray):
            obj._arrays[self.name], obj._lists[self.name] = value, None
        else:
            obj._arrays[self.name], obj._lists[self.name] = None, value


class _Values:
    """Holds `_Field`s; `lists(name)` reads one as lists. Its values do not change once made."""

    def given(self, name: str) -> bool:
        """Whether the value `name` is not None (without making its array)."""
        return self._arrays.get(name) is not None or self._lists.get(name) is not None

    def lists(self, name: str):
        """The value `name` as plain lists (rows of a (b, w) value), made once; None where it is None."""
        found = self._lists.get(name)
        if found is None:
            array = getattr(self, name)
            found = self._lists[name] = None if array is None else array.tolist()
        return found


class Group(_Values):
    """The columns an in-forward draft source adds to a lossless window step: placed after row r's
    first `anchor[r]` drafts ((b,) int64), seeing what a plain window ending there would, it feeds
    `prefix[r]` ((b, p) int64: real ids, e.g. a runner-up), then `masks` masks, which propose. Rows
    where `live[r]` ((b,) bool) is False get holes. `source`: the draft source its proposals count
    under. Each of the three is given as an array or as lists and read as either (`lists`)."""

    anchor = _Field(np.int64)
    prefix = _Field(np.int64)
    live = _Field(bool)

    def __init__(self, source: str, anchor, prefix, live, masks: int):
        self._arrays: dict = {}
        self._lists: dict = {}
        self.source, self.masks = source, masks
        self.anchor, self.prefix, self.live = anchor, prefix, live
        rows = self._lists["prefix"]
        self.prefix_width = int(self.prefix.shape[1]) if rows is None else (len(rows[0]) if rows else 0)

    @property
    def width(self) -> int:
        return self.prefix_width + self.masks


class Columns(_Values):
    """Where a step's parts sit among the fed columns: row r's last real token at `last[r]` ((b,)
    int64), its `n_drafts[r]` drafts ((b,) int64; zeros outside lossless mode), its masks, within the
    first `width` columns, then the `groups`; the cache keeps the first `keep` (rejected drafts aside).
    `draft_slots`: D, the drafts' padded width (0 outside lossless mode). Output slots (`read`): 1 + D
    AR reads (at `last`, then each draft, a row with fewer repeating its last), the masks', then every
    group column. `last` and `n_drafts` are given as arrays or lists and read as either (`lists`)."""

    last = _Field(np.int64)
    n_drafts = _Field(np.int64)

    def __init__(
        self, last, n_drafts, draft_slots: int, masks: int, width: int, keep: int, groups: tuple[Group, ...] = ()
    ):
        self._arrays: dict = {}
        self._lists: dict = {}
        self.last, self.n_drafts = last, n_drafts
        self.draft_slots, self.masks, self.width, self.keep, self.groups = draft_slots, masks, width, keep, groups

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

    def read_rows(self) -> list[list[int]]:
        """Per row, the column each output slot is read at (inside the feed even for a row feeding
        nothing): built row by row in plain Python, a step's few values cost less so than a dozen array
        operations (docs/design.md, "One step")."""
        top, d, m = self.width - 1, self.draft_slots, self.masks
        groups = list(range(self.width, self.total))  # every group column, each read
        rows = []
        for last, n in zip(self.lists("last"), self.lists("n_drafts")):
            first = last + 1 + n
            rows.append(
                [min(max(last + (j if j < n else n), 0), top) for j in range(d + 1)]
                + [min(max(first + j, 0), top) for j in range(m)]
                + groups
            )
        return rows

    def read(self) -> np.ndarray:
        """(b, k) `read_rows` as an array."""
        rows = self.read_rows()
        return np.array(rows, dtype=np.int64).reshape(
            len(rows), self.draft_slots + 1 + self.masks + self.total - self.width
        )


class Layout(_Values):
    """What one step feeds. `ids`, `positions` (b, q) int64 and `valid` (b, q) bool (False for holes);
    `limit` (b,) the tokens row r may accept this step (0: it waits); `columns`: where each row's parts
    sit (slot j of row r is read at `read[r, j]`); lossless mode: `drafts` (b, D), padded, of which row
    r fed n_drafts[r]; with groups, `see` and `start` (b, q) per fed column, the last column of the
    chain it sees and the first of its own block (masks.StepMask's). Each may be given as an array or
    as lists of rows, and is read as either (`lists`); a layout's values do not change once made.
    `keys`: (b, C + q) the cached keys' validity, then the fed columns' (the strategy's `keys`, made
    once). `holes`: whether any fed column is a hole (None: not known; `valid` says): with none, a
    step's mask needs no keys where every cached key is real (WindowStrategy.mask)."""

    ids = _Field(np.int64)
    positions = _Field(np.int64)
    valid = _Field(bool)
    limit = _Field(np.int64)
    drafts = _Field(np.int64)
    see = _Field(np.int64)
    start = _Field(np.int64)

    def __init__(
        self,
        ids,
        positions,
        valid,
        limit,
        columns: Columns,
        drafts=None,
        see=None,
        start=None,
        keys: np.ndarray | None = None,
        holes: bool | None = None,
    ):
        self._arrays: dict = {}
        self._lists: dict = {}
        self.ids, self.positions, self.valid, self.limit = ids, positions, valid, limit
        self.columns = columns
        self.drafts, self.see, self.start = drafts, see, start
        self.keys = keys
        self.holes = holes

    def lists(self, name: str):
        """The value `name` as plain lists (rows of a (b, w) value), made once; None where it is None.
        Also "read" and "n_drafts" (the columns')."""
        found = self._lists.get(name)
        if found is None:
            if name == "read":
                found = self._lists[name] = self.columns.read_rows()
            elif name == "n_drafts":
                found = self.columns.lists("n_drafts") if self.given("drafts") else None
            else:
                found = super().lists(name)
        return found

    @property
    def width(self) -> int:
        """The fed columns q."""
        rows = self._lists.get("ids")
        return len(rows[0]) if rows is not None and rows else int(self.ids.shape[1])

    @property
    def batch(self) -> int:
        rows = self._lists.get("ids")
        return len(rows) if rows is not None else int(self.ids.shape[0])

    @property
    def read(self) -> np.ndarray:
        """(b, k) the column each output slot is read at (Columns.read)."""
        found = self._arrays.get("read")
        if found is None:
            rows = self.lists("read")
            found = self._arrays["read"] = np.array(rows, dtype=np.int64).reshape(len(rows), len(rows[0]))
        return found

    @property
    def n_drafts(self) -> np.ndarray | None:
        """Lossless mode: (b,) drafts each row fed (None otherwise)."""
        return self.columns.n_drafts if self.given("drafts") else None

    @property
    def masks(self) -> int:
        """Masks fed and read per (live) row, the spare groups' not counted."""
        return self.columns.masks

    def live_groups(self, source: str) -> list[int] | None:
        """(b,) the groups of `source` each row fed live (None where the step fed none)."""
        groups = [g.lists("live") for g in self.columns.groups if g.source == source]
        return [sum(row) for row in zip(*groups)] if groups else None


def lossless_width(drafts: int, masks: int, spare_groups: int, alt_groups: int = 0) -> int:
    """Columns a row feeds in a lossless window step with its cache up to date: the token the last
    step took, its drafts, the masks, and its spare and alternative groups."""
    return 1 + drafts + masks + min(spare_groups, drafts) * masks + (alt_groups * (1 + masks) if drafts else 0)


def with_groups(ids, valid, positions, columns: Columns, mask_id: int):
    """A lossless window feed (ids, valid, positions: (b, w) arrays, or lists of rows) widened by
    `columns.groups`: the new (ids, valid, positions) and, per fed column, what it sees (`see`,
    `start`: masks.StepMask), as arrays (`with_group_rows` as lists)."""
    out = with_group_rows(ids, valid, positions, columns, mask_id)
    shape = (len(out[0]), columns.total)
    return tuple(np.array(a, dtype=bool if k == 1 else np.int64).reshape(shape) for k, a in enumerate(out))


def with_group_rows(ids, valid, positions, columns: Columns, mask_id: int):
    """`with_groups` as lists of rows. A live group sits, by position and by what it sees, as a plain
    window continuing after its anchor would: the chain up to its anchor, then its own columns;
    elsewhere its columns are holes. Built in plain Python."""
    ids, valid, fed_positions = rows_of(ids), rows_of(valid), rows_of(positions)
    b, w0 = len(ids), len(ids[0]) if ids else 0
    width = columns.total
    more = width - w0
    wide_ids = [row + [mask_id] * more for row in ids]
    wide_valid = [row + [False] * more for row in valid]
    wide_positions = [row + [0] * more for row in fed_positions]
    see = [list(range(width)) for _ in range(b)]
    start = [list(range(width)) for _ in range(b)]
    lasts = columns.lists("last")
    for k, group in enumerate(columns.groups):
        first = columns.width + columns.group_start(k)  # a group's columns lie together
        w, p = group.width, group.prefix_width
        end = first + w
        for r, (live, anchor, prefix) in enumerate(
            zip(group.lists("live"), group.lists("anchor"), group.lists("prefix"))
        ):
            anchor += lasts[r]  # the column the group follows
            if live:
                wide_ids[r][first : first + p] = prefix
                wide_valid[r][first:end] = [True] * w
                after = fed_positions[r][anchor] + 1
                wide_positions[r][first:end] = range(after, after + w)
            see[r][first:end] = [anchor] * w
            start[r][first:end] = [first] * w
    return wide_ids, wide_valid, wide_positions, see, start


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
    out, n = draft_rows(drafts, mask_id)
    return np.array(out, dtype=np.int64).reshape(len(drafts), max(n, default=0)), np.array(n, dtype=np.int64)


def draft_rows(drafts: list[list[int]], mask_id: int) -> tuple[list[list[int]], list[int]]:
    """`pad_drafts` as lists: the padded rows, and how many drafts each row has."""
    width = max((len(d) for d in drafts), default=0)
    return [list(d) + [mask_id] * (width - len(d)) for d in drafts], [len(d) for d in drafts]


def consecutive_positions(valid: np.ndarray, first: list[int]) -> np.ndarray:
    """Consecutive positions over each row's valid slots, starting at first[r]; holes get 0."""
    pos = np.cumsum(valid, axis=1) - 1 + np.asarray(first, dtype=np.int64)[:, None]
    return np.where(valid, pos, 0)


def layout_mask(keys: np.ndarray, layout: Layout) -> StepMask | None:
    """The attention mask of a step (masks.StepMask): causal over the cache and the fed columns, with
    holes, narrowed by the layout's `see` and `start` for the groups; None where plain causal
    attention is exact."""
    q = layout.width
    every = bool(keys.all())
    see = layout.lists("see")
    if every and see is None:
        return None
    return StepMask(keys.shape[1] - q, q, None if every else keys, see, layout.lists("start"))
