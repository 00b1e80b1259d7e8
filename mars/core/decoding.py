"""The decoding loop (docs/method.md §5-6): one loop, small strategies that say what to feed and commit.

Per step the strategy lays out what every row feeds on top of its committed cache,
the backend runs one forward and returns per-slot (id, confidence) on the host,
the acceptance rule decides how many leading slots each row keeps, and the
strategy commits: it tells the backend how far to crop the cache.

Lossless mode (docs/method.md §8) runs on the same strategies: each row also feeds, as real ids,
the drafts its masks proposed last step, right after its uncommitted tokens and before
its masks. The outputs before the drafts are the AR predictions for them, so a draft is
kept while it equals that prediction (greedy) or passes the speculative-sampling test
(done by the backend), and one AR token always follows. Rejected drafts become holes.

Rows of a batch share one cache length. Rows that fed fewer tokens than others
leave holes: keys nobody attends (`key_valid` False), so every row sees exactly
the sequence it would see alone, at its own positions.

`generate` decodes a fixed set of prompts to the end; `ContinuousBatch` runs the same
step on the block strategy for a server, with rows joining at block boundaries, leaving
at any step, and each decoding at its own threshold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from . import ngram
from .acceptance import accept_counts, ar_mode_rows, check_metric, check_threshold, is_ar_mode
from .cost import CostCurve, DraftStats, FeedPolicy
from .masks import decode_mask

STRATEGIES = ("none", "window", "block")


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def divisor(self) -> float:
        """What the backends divide the (float32, top-shifted-to-0) logits by: the temperature,
        floored at 1e-30, a normal float32 (1e-69 is 0.0 there and x / 0.0 is NaN); a vanishing
        temperature then sends every logit but the top to -inf, the greedy limit."""
        return max(self.temperature, 1e-30)


@dataclass
class DecodeSettings:
    mask_id: int
    eos_ids: tuple[int, ...]
    block_size: int = 4  # B: masks per step; a step accepts at most B + 1 tokens per row
    threshold: float = 1.0
    metric: str = "probability"
    max_tokens: int = 256
    cache: str = "window"  # none | window | block
    block_cache: int = 16  # B_cache, slots per aligned block of the block strategy
    sampling: Sampling = field(default_factory=Sampling)
    lossless: bool = False  # masks draft, the next forward verifies: output exactly AR's (docs/method.md §8)
    # Lossless, greedy, window or no cache: also feed up to `hedge` spare groups of B masks, group
    # g placed after the g-th draft (group 0 right after the last verified token) and attending
    # only to what precedes it. When draft g + 1 is the first one rejected, the step still takes
    # the AR token there, and group g's proposals (conditioned on verified tokens only) become the
    # next drafts instead of none. Output stays AR's; only the drafts change. Each group costs B
    # more fed tokens per step. None: B groups (after every draft); 0: no spare groups.
    hedge: int | None = None
    # Lossless, greedy, window or no cache: also draft from n-gram lookup in the prompt and output
    # (mars.core.ngram), up to this many tokens a step (0: off); a row takes, per step, the source
    # expected to keep more. (Sampled drafts need the distribution they came from; lookup has none.)
    ngram: int = 0

    def __post_init__(self):
        check_metric(self.metric)
        self.threshold = check_threshold(self.metric, self.threshold)
        if self.cache not in STRATEGIES:
            raise ValueError(f"cache must be one of {', '.join(STRATEGIES)}, got {self.cache!r}")
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        if self.block_cache < 1:
            raise ValueError(f"block cache size must be >= 1, got {self.block_cache}")
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {self.max_tokens}")
        if self.hedge is not None and self.hedge < 0:
            raise ValueError(f"hedge must be >= 0 spare mask groups, got {self.hedge}")
        if self.ngram < 0:
            raise ValueError(f"n-gram drafts must be >= 0, got {self.ngram}")

    @property
    def no_spare_groups(self) -> str | None:
        """Why this run feeds no spare mask groups whatever `hedge` says, or None when it may:
        greedy lossless with the window cache or none only (a sampled draft's acceptance needs
        the distribution it was drawn from; spare groups would need theirs kept too)."""
        if not self.lossless:
            return "spare mask groups are a lossless-mode feature"
        if not self.sampling.greedy:
            return "lossless sampling runs without spare mask groups (they apply to greedy decoding)"
        if self.cache == "block":
            return "the block cache runs without spare mask groups (they need the window cache or none)"
        return None

    @property
    def hedges(self) -> int:
        """Spare mask groups a window step feeds (see `hedge` and `no_spare_groups`)."""
        if self.no_spare_groups:
            return 0
        return self.block_size if self.hedge is None else min(self.hedge, self.block_size)

    @property
    def masks_per_step(self) -> int:
        # In AR mode the masks could never be accepted: feed none (a one-slot window).
        # Lossless mode ignores the threshold: its masks only draft.
        if self.lossless:
            return self.block_size
        return 0 if is_ar_mode(self.metric, self.threshold) else self.block_size


class StepBackend(Protocol):
    """What the loop needs from a backend (see mars/backends/base.py)."""

    def new_cache(self, batch: int) -> Any: ...

    def crop(self, cache: Any, length: int) -> None: ...

    def step(self, cache, input_ids, positions, mask, read, *, metric, sampling) -> tuple[np.ndarray, np.ndarray]:
        """Forward `input_ids` (b, q) at `positions` on top of `cache` (None: no cache)
        under `mask` (b, q, kv) bool or None (plain causal, no holes); return
        (ids, confidence), each (b, k), for the outputs at `read` (b, k) indices into q.
        `metric` None (greedy AR): the argmax ids alone; confidences may be zeros."""
        ...

    def keep_rows(self, cache, rows: list[int]) -> None:
        """Keep only these batch rows of the cache (None: no cache) and of any per-row state
        kept for speculate."""
        ...

    def speculate(self, cache, input_ids, positions, mask, read, drafts, n_drafts, *, sampling) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Lossless sampling, on the device. `read` (b, 1 + D + m): the outputs before each of
        the D draft slots and after the last (AR), then the m masks. Row r's first
        `n_drafts[r]` ids of `drafts` (b, D) were drawn by the previous call from its mask
        distributions q, which the backend kept. Returns (kept (b,), token (b,), new drafts
        (b, m)): drafts kept by the speculative-sampling rule (accept with min(1, p/q)), then
        a token drawn from norm(max(0, p - q)) at the first rejection, or from p after the
        last draft; new drafts are drawn from this step's mask distributions, kept for the next call."""
        ...


@dataclass
class Feed:
    ids: np.ndarray  # (b, q) int64
    positions: np.ndarray  # (b, q) int64
    valid: np.ndarray  # (b, q) bool: False for holes
    read: np.ndarray  # (b, k) indices into q: slot j of row r is read at read[r, j]
    limit: np.ndarray  # (b,) tokens row r may accept this step; 0 = it waits
    # Lossless mode: the drafts fed (b, D), padded, of which row r fed n_drafts[r]; `read`
    # then holds 1 + D AR reads (the last real token's output, then each draft's) and the
    # masks' reads. `kept` (b,) is filled in by the loop: drafts that passed verification.
    drafts: np.ndarray | None = None
    n_drafts: np.ndarray | None = None
    kept: np.ndarray | None = None
    # Lossless with spare groups: `groups` groups of masks are the last columns (read after the
    # masks' reads), and `attend` (b, q, q) limits which fed columns each fed query may see.
    groups: int = 0
    attend: np.ndarray | None = None
    masks: int = 0  # masks fed per (live) row, spare groups not counted


@dataclass
class RowStats:
    forwards: int = 0  # forwards that produced at least one token for this row
    waited: int = 0  # forwards in which the row was unfinished but took nothing
    accepted: int = 0
    accepted_per_slot: list[int] = field(default_factory=list)
    # Lossless mode, per draft slot: proposed by the masks, fed for verification, kept.
    drafted_per_slot: list[int] = field(default_factory=list)
    verified_per_slot: list[int] = field(default_factory=list)
    kept_per_slot: list[int] = field(default_factory=list)
    # Lossless mode: tokens taken, by where they came from: drafts of the masks, of the spare
    # groups or of n-gram lookup (kept by verification), and the AR token every step takes.
    by_source: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_forward(self) -> float:
        return self.accepted / self.forwards if self.forwards else 0.0


@dataclass
class DecodeStats:
    rows: list[RowStats]
    forwards: int = 0  # batch forwards run
    fed_tokens: int = 0  # token slots fed, holes included (the compute spent)
    drafting: Drafting | None = field(default=None, repr=False)  # greedy lossless window decoding

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rows)

    @property
    def row_forwards(self) -> int:
        return sum(r.forwards for r in self.rows)

    @property
    def tokens_per_forward(self) -> float:
        """Accepted tokens / counted forwards, summed over rows (docs/method.md §5, Counting)."""
        return self.accepted / self.row_forwards if self.row_forwards else 0.0

    def to_dict(self) -> dict:
        return {
            "forwards": self.forwards,
            "fed_tokens": self.fed_tokens,
            "accepted": self.accepted,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "rows": [
                {
                    "forwards": r.forwards,
                    "waited": r.waited,
                    "accepted": r.accepted,
                    "tokens_per_forward": round(r.tokens_per_forward, 4),
                    "accepted_per_slot": r.accepted_per_slot,
                    **(
                        {"drafted_per_slot": r.drafted_per_slot, "verified_per_slot": r.verified_per_slot, "kept_per_slot": r.kept_per_slot}
                        if r.drafted_per_slot
                        else {}
                    ),
                    **({"by_source": dict(r.by_source)} if r.by_source else {}),
                }
                for r in self.rows
            ],
        }

    def draft_totals(self) -> dict:
        """Lossless mode: drafts proposed, verified and kept, per draft slot, summed over rows."""
        def total(name):
            per = [getattr(r, name) for r in self.rows if getattr(r, name)]
            return [int(x) for x in np.sum(per, axis=0)] if per else []

        return {"drafted_per_slot": total("drafted_per_slot"), "verified_per_slot": total("verified_per_slot"), "kept_per_slot": total("kept_per_slot")}

    def by_source(self) -> dict[str, int]:
        """Lossless mode: tokens taken per source (masks, spare, ngram, ar), summed over rows."""
        out: dict[str, int] = {}
        for r in self.rows:
            for k, v in r.by_source.items():
                out[k] = out.get(k, 0) + v
        return out


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # generated ids per row, an accepted EOS included
    finish: list[str]  # "eos" or "length"
    stats: DecodeStats


class _Row:
    def __init__(self, prompt: list[int], slots: int, *, threshold: float, max_tokens: int):
        self.seq = list(prompt)  # prompt + accepted output
        self.prompt_len = len(prompt)
        self.threshold = threshold  # per row: the rows of a served batch differ (ContinuousBatch)
        self.max_tokens = max_tokens
        self.cached = 0  # real tokens of `seq` already in the cache
        self.done = False
        self.finish = ""
        self.drafts: list[int] = []  # lossless: the masks' last proposals, verified next step
        self.source = "masks"  # where `drafts` came from: masks | spare | ngram
        self.stats = RowStats(accepted_per_slot=[0] * slots)

    @property
    def out(self) -> list[int]:
        return self.seq[self.prompt_len :]


def _right_aligned(parts: list[list[int]], width: int, mask_id: int, n_masks: list[int]):
    """Lay rows out right-aligned: [holes][tokens][masks]; returns ids, valid."""
    batch = len(parts)
    ids = np.full((batch, width), mask_id, dtype=np.int64)
    valid = np.zeros((batch, width), dtype=bool)
    for r, (toks, m) in enumerate(zip(parts, n_masks)):
        start = width - len(toks) - m
        ids[r, start : start + len(toks)] = toks
        valid[r, start:] = True
    return ids, valid


def _pad_drafts(drafts: list[list[int]], mask_id: int) -> tuple[np.ndarray, np.ndarray]:
    width = max((len(d) for d in drafts), default=0)
    out = np.full((len(drafts), width), mask_id, dtype=np.int64)
    for r, d in enumerate(drafts):
        out[r, : len(d)] = d
    return out, np.asarray([len(d) for d in drafts], dtype=np.int64)


def _lossless_read(last: np.ndarray, n_drafts: np.ndarray, width_drafts: int, first_mask: np.ndarray, masks: int, width: int):
    """1 + D AR reads (the output at the last real token, then at each draft; padded by
    repeating a row's last one), then the masks' reads. A row that feeds nothing (finished,
    still in the batch) reads column 0: its reads are ignored but must exist."""
    ar = last[:, None] + np.minimum(np.arange(width_drafts + 1)[None, :], n_drafts[:, None])
    mk = np.minimum(first_mask[:, None] + np.arange(masks)[None, :], width - 1)
    return np.clip(np.concatenate([ar, mk], axis=1), 0, width - 1)


def _add_groups(feed: Feed, groups: int, masks: int, mask_id: int, done: list[bool]) -> None:
    """Append `groups` spare groups of `masks` masks to a lossless window feed (in place).

    Group g of a row that fed more than g drafts sits, by position and by what it attends to,
    right after its g-th draft (g = 0: after the last verified token): each of its masks sees
    the fed columns up to that token and the group's masks before it, as the masks of a plain
    window ending there would. Other rows' group columns are holes. The groups' reads follow
    the masks' reads in `feed.read`."""
    b, w0 = feed.ids.shape
    width = w0 + groups * masks
    n = feed.n_drafts
    before = w0 - masks - 1 - n  # column of the last verified token fed (the drafts follow it)
    ids = np.full((b, width), mask_id, dtype=np.int64)
    ids[:, :w0] = feed.ids
    valid = np.zeros((b, width), dtype=bool)
    valid[:, :w0] = feed.valid
    positions = np.zeros((b, width), dtype=np.int64)
    positions[:, :w0] = feed.positions
    attend = np.tril(np.ones((width, width), dtype=bool))
    attend = np.broadcast_to(attend, (b, width, width)).copy()
    attend[:, w0:, :] = False
    rows = np.arange(b)
    for g in range(groups):
        cols = w0 + g * masks + np.arange(masks)
        live = (g < n) & ~np.asarray(done, dtype=bool)
        valid[:, cols] = live[:, None]
        anchor = before + g  # the column the group follows
        positions[:, cols] = np.where(live[:, None], feed.positions[rows, anchor][:, None] + 1 + np.arange(masks)[None, :], 0)
        upto = np.arange(w0)[None, :] <= anchor[:, None]  # (b, w0): fed columns the group sees
        attend[:, cols, :w0] = upto[:, None, :]
        attend[:, cols[:, None], cols[None, :]] = np.tril(np.ones((masks, masks), dtype=bool))[None]
    group_read = w0 + np.arange(groups * masks)
    feed.ids, feed.valid, feed.positions = ids, valid, positions
    feed.read = np.concatenate([feed.read, np.broadcast_to(group_read, (b, group_read.size))], axis=1)
    feed.groups, feed.attend = groups, attend


def _positions(valid: np.ndarray, first: list[int]) -> np.ndarray:
    """Consecutive positions over each row's valid slots, starting at first[r]; holes get 0."""
    pos = np.cumsum(valid, axis=1) - 1 + np.asarray(first, dtype=np.int64)[:, None]
    return np.where(valid, pos, 0)


class WindowStrategy:
    """Sliding window (docs/method.md §5-6): feed what is not yet cached, then B masks.

    With `cached=False` nothing is kept: every step feeds the whole sequence.
    With `cached=True` the cache keeps committed tokens only; mask entries are cropped.
    """

    def __init__(self, settings: DecodeSettings, cached: bool):
        self.s = settings
        self.cached = cached
        self.key_valid: np.ndarray | None = None  # (b, cache_len) for the cached variant
        # Per step, a cost-aware loop may narrow these (FeedPolicy); lossless output stays AR's.
        self.masks = settings.masks_per_step
        self.groups = settings.hedges

    def plan(self, rows: list[_Row]) -> Feed:
        s, m = self.s, self.masks
        # Lossless: as many drafts as leave room for the AR token after them.
        drafts = [[] if r.done else r.drafts[: r.max_tokens - len(r.out) - 1] for r in rows]
        parts = [[] if r.done else r.seq[r.cached :] + d for r, d in zip(rows, drafts)]
        masks = [0 if r.done else m for r in rows]
        width = max(len(p) for p in parts) + m
        ids, valid = _right_aligned(parts, width, s.mask_id, masks)
        positions = _positions(valid, [r.cached for r in rows])
        if not s.lossless:
            read = np.tile(np.arange(width - m - 1, width), (len(rows), 1))
            limit = [0 if r.done else min(m + 1, r.max_tokens - len(r.out)) for r in rows]
            return Feed(ids, positions, valid, read, np.asarray(limit), masks=m)
        padded, n = _pad_drafts(drafts, s.mask_id)
        first_mask = np.full(len(rows), width - m)
        read = _lossless_read(first_mask - n - 1, n, padded.shape[1], first_mask, m, width)
        limit = np.asarray([0 if r.done else k + 1 for r, k in zip(rows, n)])
        feed = Feed(ids, positions, valid, read, limit, drafts=padded, n_drafts=n, masks=m)
        # A group follows a draft: no more groups than the most drafts any row feeds.
        groups = min(self.groups, int(n.max(initial=0))) if m else 0
        if groups:
            _add_groups(feed, groups, m, s.mask_id, [r.done for r in rows])
        return feed

    def keep_rows(self, keep: list[int]) -> None:
        if self.key_valid is not None:
            self.key_valid = self.key_valid[keep]

    def keys(self, feed: Feed) -> np.ndarray:
        if not self.cached or self.key_valid is None:
            return feed.valid
        return np.concatenate([self.key_valid, feed.valid], axis=1)

    def commit(self, backend, cache, rows: list[_Row], feed: Feed, before: list[int]) -> None:
        if not self.cached:
            return
        # Keep the real tokens just fed; the masks' keys were computed from MASK and go.
        fed_real = feed.ids.shape[1] - feed.masks * (1 + feed.groups)
        old = 0 if self.key_valid is None else self.key_valid.shape[1]
        self.key_valid = self.keys(feed)[:, : old + fed_real].copy()
        if feed.kept is not None:  # rejected drafts were computed from wrong ids: make them holes
            for r, (n, k) in enumerate(zip(feed.n_drafts, feed.kept)):
                self.key_valid[r, old + fed_real - n + k : old + fed_real] = False
            # Rows are right-aligned, so rejected drafts end every row's columns: the tail no
            # row attends leaves the cache at once (at batch 1, every rejected draft).
            live = self.key_valid[:, old:].any(axis=0)
            end = old + (int(np.flatnonzero(live)[-1]) + 1 if live.any() else 0)
            self.key_valid = self.key_valid[:, :end]
        backend.crop(cache, self.key_valid.shape[1])
        for r, b in zip(rows, before):
            r.cached = b


class BlockStrategy:
    """Block-level cache for batches (docs/method.md §6).

    Rows stay aligned on blocks of B_cache generated tokens. Inside a block every
    step feeds the block's slots (filled ones real, the rest masks) on the
    block-start cache; a row that filled its block waits. The finished block is
    committed by feeding it in front of the next block's first step, and the
    prompt in front of the first block's, so no forward is spent on commits alone.
    """

    def __init__(self, settings: DecodeSettings):
        self.s = settings
        self.masks = settings.masks_per_step  # a served batch sets it per step from its rows' thresholds
        self.key_valid: np.ndarray | None = None
        self.block_start: list[int] = []  # len(seq) at the start of each row's block

    def plan(self, rows: list[_Row]) -> Feed:
        s, size = self.s, self.s.block_cache
        if not self.block_start:
            self.block_start = [len(r.seq) for r in rows]
        fold = [r.seq[r.cached : start] if not r.done else [] for r, start in zip(rows, self.block_start)]
        width_fold = max(len(f) for f in fold)
        fold_ids, fold_valid = _right_aligned(fold, width_fold, s.mask_id, [0] * len(rows))
        fill = [len(r.seq) - start for r, start in zip(rows, self.block_start)]
        waiting = [r.done or f >= size for r, f in zip(rows, fill)]
        room = [min(size - f, r.max_tokens - len(r.out)) for r, f in zip(rows, fill)]
        # Lossless: drafts fill the slots after the row's real ones, leaving room for the AR token.
        drafts = [[] if w or not s.lossless else r.drafts[: k - 1] for r, w, k in zip(rows, waiting, room)]
        blk_ids = np.full((len(rows), size), s.mask_id, dtype=np.int64)
        blk_valid = np.zeros((len(rows), size), dtype=bool)
        for i, (r, start, f, d) in enumerate(zip(rows, self.block_start, fill, drafts)):
            if not waiting[i]:
                blk_ids[i, :f] = r.seq[start:]
                blk_ids[i, f : f + len(d)] = d
                blk_valid[i] = True
        ids = np.concatenate([fold_ids, blk_ids], axis=1)
        valid = np.concatenate([fold_valid, blk_valid], axis=1)
        positions = _positions(valid, [r.cached for r in rows])
        self._fold_width = width_fold
        last = width_fold + np.asarray(fill) - 1
        if s.lossless:
            padded, n = _pad_drafts(drafts, s.mask_id)
            read = _lossless_read(last, n, padded.shape[1], last + n + 1, self.masks, ids.shape[1])
            limit = np.asarray([0 if w else k + 1 for w, k in zip(waiting, n)])
            return Feed(ids, positions, valid, read, limit, drafts=padded, n_drafts=n, masks=self.masks)
        slots = self.masks + 1
        read = np.clip(last[:, None] + np.arange(slots)[None, :], 0, ids.shape[1] - 1)
        limit = [0 if w else min(slots, k) for w, k in zip(waiting, room)]
        return Feed(ids, positions, valid, read, np.asarray(limit), masks=self.masks)

    def keep_rows(self, keep: list[int]) -> None:
        if self.key_valid is not None:
            self.key_valid = self.key_valid[keep]
        if self.block_start:
            self.block_start = [self.block_start[j] for j in keep]

    def add_row(self, row: _Row) -> None:
        """A row joins the batch at a block boundary (ContinuousBatch): the keys cached so far
        are holes to it, and its first block starts where its prompt ends."""
        self.block_start.append(len(row.seq))
        if self.key_valid is not None:
            self.key_valid = np.concatenate([self.key_valid, np.zeros((1, self.key_valid.shape[1]), dtype=bool)])

    def next_block_if_filled(self, rows: list[_Row]) -> None:
        """Once every row filled (or finished) its block, the next step commits it and starts the next."""
        size = self.s.block_cache
        if self.block_start and all(r.done or len(r.seq) - start >= size for r, start in zip(rows, self.block_start)):
            self.block_start = [len(r.seq) for r in rows]

    def keys(self, feed: Feed) -> np.ndarray:
        if self.key_valid is None:
            return feed.valid
        return np.concatenate([self.key_valid, feed.valid], axis=1)

    def commit(self, backend, cache, rows: list[_Row], feed: Feed, before: list[int]) -> None:
        old = 0 if self.key_valid is None else self.key_valid.shape[1]
        self.key_valid = self.keys(feed)[:, : old + self._fold_width]
        backend.crop(cache, self.key_valid.shape[1])
        for r, start in zip(rows, self.block_start):
            if not r.done:
                r.cached = start
        self.next_block_if_filled(rows)


def _verify(backend, cache, feed: Feed, mask, s: DecodeSettings) -> tuple[list[list[int]], list[list[int]]]:
    """Lossless step: per row, the tokens it takes (kept drafts, then one AR token; none for
    a waiting row) and its next drafts: the masks' proposals if every draft passed, else those
    of the spare group after the last kept draft if there is one, else none. Sets `feed.kept`."""
    width = feed.drafts.shape[1]
    spare = None
    if s.sampling.greedy:
        ids, _ = backend.step(cache, feed.ids, feed.positions, mask, feed.read, metric=None, sampling=s.sampling)
        masks = feed.masks
        ar, proposals = ids[:, : width + 1], ids[:, width + 1 : width + 1 + masks]
        spare = ids[:, width + 1 + masks :].reshape(len(ids), feed.groups, masks)
        same = (feed.drafts == ar[:, :width]) & (np.arange(width)[None, :] < feed.n_drafts[:, None])
        kept = np.cumprod(same, axis=1).sum(axis=1).astype(np.int64)
        token = ar[np.arange(len(ar)), kept]
    else:
        kept, token, proposals = backend.speculate(
            cache, feed.ids, feed.positions, mask, feed.read, feed.drafts, feed.n_drafts, sampling=s.sampling
        )
        kept = np.asarray(kept, dtype=np.int64)
    feed.kept = np.where(feed.limit > 0, kept, 0)
    accepted = [
        [int(t) for t in feed.drafts[i, : kept[i]]] + [int(token[i])] if feed.limit[i] > 0 else [] for i in range(len(kept))
    ]
    # The masks' proposals were conditioned on every draft: wrong once one failed.
    nxt = []
    for i in range(len(kept)):
        if kept[i] == feed.n_drafts[i]:
            nxt.append(("masks", [int(t) for t in proposals[i]]))
        elif spare is not None and kept[i] < feed.groups:
            nxt.append(("spare", [int(t) for t in spare[i, kept[i]]]))
        else:
            nxt.append(("masks", []))
    return accepted, nxt


def _count_drafts(r: _Row, verified: int, kept: int, nxt: tuple[str, list[int]], masks: int) -> None:
    """Lossless bookkeeping, per draft slot: drafts fed, verified and kept, and the tokens
    taken per source; `nxt` (source, drafts) are the next step's (see `_verify`)."""
    st = r.stats
    source, drafts = nxt
    width = max(masks, verified, len(drafts))
    for counts in ("drafted_per_slot", "verified_per_slot", "kept_per_slot"):
        row = getattr(st, counts)
        row.extend([0] * (width - len(row)))
    if kept:
        st.by_source[r.source] = st.by_source.get(r.source, 0) + kept
    st.by_source["ar"] = st.by_source.get("ar", 0) + 1
    r.source = source
    for j in range(verified):
        st.verified_per_slot[j] += 1
    for j in range(kept):
        st.kept_per_slot[j] += 1
    r.drafts = list(drafts)
    for j in range(len(r.drafts)):
        st.drafted_per_slot[j] += 1


class Drafting:
    """Greedy lossless window decoding: which drafts each row feeds, and how wide a step is.

    Per step, before the plan: with a cost curve, `FeedPolicy` picks the masks and spare
    groups to feed (none: AR's feed, and a row's mask drafts are dropped); with n-gram
    lookup on, a row drafts from lookup instead of the masks when lookup is expected to
    keep more (`DraftStats`, per source and slot), and a row with no drafts takes lookup's
    if it pays. After the forward: the acceptance statistics and the cost curve learn."""

    def __init__(self, settings: DecodeSettings, cost: CostCurve | FeedPolicy | None):
        self.s = settings
        if isinstance(cost, FeedPolicy) and not cost.fits(settings.block_size, settings.hedges):
            cost = cost.curve  # another block size or hedge cap: start a policy for it
        if isinstance(cost, CostCurve):
            cost = FeedPolicy(cost, settings.block_size, settings.hedges)
        self.policy = cost
        self.stats = cost.stats if cost is not None else DraftStats(slots=settings.block_size)

    def before_step(self, strategy: WindowStrategy, rows: list[_Row]) -> None:
        live = [r for r in rows if not r.done]
        batch = max(1, len(live))
        if self.policy is not None:
            strategy.masks, strategy.groups = self.policy.choose(batch=batch)
        m = strategy.masks
        for r in live:
            options = [(r.source, r.drafts[: max(m, 1)])] if r.drafts else []
            if self.s.ngram:
                found = ngram.lookup(r.seq, max_drafts=self.s.ngram)
                if found:
                    options.append(("ngram", found))
            r.source, r.drafts = self._pick(options, m, strategy.groups, batch)

    def _pick(self, options, masks: int, groups: int, batch: int) -> tuple[str, list[int]]:
        """The drafts a row feeds: without a cost curve, the option expected to keep the most
        drafts; with one, the option and length that maximise expected tokens per second of
        this step ((1 + expected kept) / cost of the step's width)."""
        st, best = self.stats, ("masks", [])
        # Feeding no drafts is the option to beat.
        best_score = 1.0 / self.policy.curve.seconds(batch * (1 + masks)) if self.policy is not None else 0.0
        for source, drafts in options:
            lengths = range(1, len(drafts) + 1) if self.policy is not None else [len(drafts)]
            for d in lengths:
                kept = st.expected_kept(source, d)
                if self.policy is None:
                    score = kept
                else:
                    width = 1 + d + masks + min(groups, d) * masks
                    score = (1 + kept) / self.policy.curve.seconds(batch * width)
                if score > best_score:
                    best, best_score = (source, drafts[:d]), score
        return best

    def after_step(self, feed: Feed, rows: list[_Row], seconds: float) -> None:
        for i, r in enumerate(rows):
            if feed.limit[i] > 0 and feed.n_drafts[i]:
                self.stats.record(r.source, int(feed.n_drafts[i]), int(feed.kept[i]))
        if self.policy is not None:
            self.policy.curve.observe(int(feed.ids.size), seconds)


def _strategy(settings: DecodeSettings):
    if settings.cache == "block":
        return BlockStrategy(settings)
    return WindowStrategy(settings, cached=settings.cache == "window")


def generate(
    backend: StepBackend,
    prompts: list[list[int]],
    settings: DecodeSettings,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    cost: CostCurve | FeedPolicy | None = None,
) -> DecodeResult:
    """Decode every prompt; `on_tokens(row, ids)` sees each row's tokens as they are accepted.

    `cost`, the backend's per-forward cost curve (mars.core.cost), or a `FeedPolicy` built on
    one (which keeps its acceptance statistics from call to call): greedy lossless decoding
    with the window cache (or none) then chooses per step how many masks and spare groups
    to feed (`block_size` and `hedge` become caps). The output is the same either way."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    s = settings
    slots = s.masks_per_step + 1
    rows = [_Row(p, slots, threshold=s.threshold, max_tokens=s.max_tokens) for p in prompts]
    strategy = _strategy(s)
    cache = backend.new_cache(len(rows))  # also resets the backend's per-row state
    if s.cache == "none":
        cache = None
    stats = DecodeStats(rows=[r.stats for r in rows])
    if s.lossless and s.sampling.greedy and isinstance(strategy, WindowStrategy):
        stats.drafting = Drafting(s, cost)

    live = list(range(len(rows)))  # rows still in the batch (finished ones are dropped in bulk)
    everyone = rows
    while live:
        rows = [everyone[i] for i in live]
        accepted = _advance(backend, cache, strategy, rows, s, stats)
        if on_tokens is not None:
            for i, new in enumerate(accepted):
                if new:
                    on_tokens(live[i], new)
        live = _compact(backend, cache, strategy, rows, live)

    rows = everyone
    return DecodeResult(tokens=[r.out for r in rows], finish=[r.finish for r in rows], stats=stats)


def feed_mask(keys: np.ndarray, feed: Feed) -> np.ndarray | None:
    """The attention mask of a step: causal over the cache and the fed columns, with holes
    (None when plain causal attention is exact), narrowed by `feed.attend` where spare mask
    groups must see only what precedes them."""
    q = feed.ids.shape[1]
    if keys.all() and feed.attend is None:
        return None
    mask = decode_mask(keys, q)
    if feed.attend is not None:  # its diagonal is set, so a hole still sees itself
        mask[:, :, -q:] &= feed.attend
    return mask


def _advance(backend, cache, strategy, rows: list[_Row], s: DecodeSettings, stats: DecodeStats) -> list[list[int]]:
    """One forward of the loop: the strategy lays out what every row feeds, the backend runs
    it, the acceptance rule (each row at its own threshold) decides what each row keeps, the
    rows grow and the strategy commits. Returns the tokens each row took (none if it waited)."""
    drafting = stats.drafting
    if drafting is not None:
        drafting.before_step(strategy, rows)
    feed = strategy.plan(rows)
    mask = feed_mask(strategy.keys(feed), feed)
    stats.forwards += 1
    stats.fed_tokens += feed.ids.size
    if s.lossless:
        t0 = time.perf_counter()
        accepted, proposals = _verify(backend, cache, feed, mask, s)
        if drafting is not None:
            drafting.after_step(feed, rows, time.perf_counter() - t0)
    else:
        thresholds = np.asarray([r.threshold for r in rows], dtype=np.float64)
        # Greedy AR accepts slot 0 by rule: no confidence is needed, so none is computed.
        step_metric = None if ar_mode_rows(s.metric, thresholds).all() and s.sampling.greedy else s.metric
        ids, conf = backend.step(
            cache, feed.ids, feed.positions, mask, feed.read, metric=step_metric, sampling=s.sampling
        )
        counts = accept_counts(conf, s.metric, thresholds, feed.limit)
        accepted = [[int(t) for t in ids[i, : counts[i]]] for i in range(len(rows))]
    # What each row had fed for real: the cached variants commit it (kept drafts too).
    before = [len(r.seq) if not r.done else r.cached for r in rows]
    eos = set(s.eos_ids)
    for i, r in enumerate(rows):
        if r.done:
            accepted[i] = []
            continue
        new = accepted[i]
        if not new:
            r.stats.waited += 1
            continue
        if s.lossless:
            _count_drafts(r, int(feed.n_drafts[i]), int(feed.kept[i]), proposals[i], s.masks_per_step)
            before[i] += int(feed.kept[i])
        for j, t in enumerate(new):
            if t in eos:
                new = new[: j + 1]
                r.done, r.finish = True, "eos"
                break
        accepted[i] = new
        r.seq.extend(new)
        r.stats.forwards += 1
        r.stats.accepted += len(new)
        per_slot = r.stats.accepted_per_slot
        per_slot.extend([0] * (len(new) - len(per_slot)))  # n-gram drafts may outnumber the masks
        for j in range(len(new)):
            per_slot[j] += 1
        if not r.done and len(r.out) >= r.max_tokens:
            r.done, r.finish = True, "length"
    strategy.commit(backend, cache, rows, feed, before)
    return accepted


def _compact(backend, cache, strategy, rows: list[_Row], live: list[int]) -> list[int]:
    """Drop finished rows from the batch once they are a quarter of it (or all of it): a
    finished row still costs a slot of every forward. The others' caches are untouched."""
    keep = [j for j, r in enumerate(rows) if not r.done]
    if len(keep) == len(rows) or (keep and 4 * (len(rows) - len(keep)) < len(rows)):
        return live
    if keep:
        backend.keep_rows(cache, keep)
        strategy.keep_rows(keep)
    return [live[j] for j in keep]


class ContinuousBatch:
    """Block-cache decoding (docs/method.md §6) for a server: rows join at block boundaries and leave
    whenever they finish or are removed.

    Each row decodes at its own threshold (which the caller may change between steps) and
    stops at its own max_tokens; lossless mode and sampling belong to the batch, since a
    backend step samples every row alike. A row joins only at a block boundary (`can_join`),
    so its blocks start where its prompt ends, as when it is decoded alone: with a greedy
    decoder its tokens are those of `generate(..., cache="block")` on its prompt alone,
    whatever else is in the batch. Its prompt is fed in the first step of the block, with
    the other rows' previous block. A finished or removed row leaves at once; a block is
    committed once every remaining row has filled it.

    `keep_keys(cache, columns)`, when given, keeps only those cache positions of every layer;
    it lets the batch drop the keys of rows that left, so a batch that never empties keeps a
    bounded cache. Without it the cache is released only when the batch empties.
    """

    def __init__(self, backend: StepBackend, settings: DecodeSettings, keep_keys: Callable[[Any, np.ndarray], None] | None = None):
        self.backend = backend
        self.s = settings
        self.keep_keys = keep_keys
        self.rows: list[_Row] = []
        self.stats = DecodeStats(rows=[])  # forwards and fed tokens of the batch; rows keep their own
        self.strategy = BlockStrategy(settings)
        self.cache = None

    @property
    def can_join(self) -> bool:
        """At a block boundary: no row has filled any slot of the current block yet."""
        return all(len(r.seq) == start for r, start in zip(self.rows, self.strategy.block_start))

    def join(self, prompt: list[int], *, threshold: float | None = None, max_tokens: int | None = None) -> _Row:
        """Add a row (only when `can_join`); it takes part in the next step. Returns the row:
        its `out`, `done`, `finish`, `stats` and `threshold` are the caller's to read, and
        `threshold` to set."""
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if not self.can_join:
            raise RuntimeError("rows join at block boundaries: wait until can_join")
        s = self.s
        row = _Row(
            prompt,
            s.block_size + 1,
            threshold=s.threshold if threshold is None else check_threshold(s.metric, threshold),
            max_tokens=s.max_tokens if max_tokens is None else max_tokens,
        )
        if not self.rows:
            self.strategy = BlockStrategy(s)
            self.cache = self.backend.new_cache(1)
        else:
            # The new row's entries copy row 0's; they are holes to it, never attended.
            self.backend.keep_rows(self.cache, list(range(len(self.rows))) + [0])
        self.strategy.add_row(row)
        self.rows.append(row)
        return row

    def leave(self, rows: list[_Row]) -> None:
        """Remove rows (finished or not) from the batch at once."""
        gone = {id(r) for r in rows}
        keep = [j for j, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[j] for j in keep]
        if not self.rows:
            self.strategy = BlockStrategy(self.s)
            self.cache = None
            return
        self.backend.keep_rows(self.cache, keep)
        self.strategy.keep_rows(keep)
        self.strategy.next_block_if_filled(self.rows)
        self._drop_dead_keys()

    def step(self) -> list[tuple[_Row, list[int]]]:
        """One forward for every row; returns (row, tokens) for the rows that took tokens.
        Rows that finished in this step have left the batch when it returns."""
        if not self.rows:
            return []
        s = self.s
        all_ar = ar_mode_rows(s.metric, [r.threshold for r in self.rows]).all()
        self.strategy.masks = 0 if all_ar and not s.lossless else s.block_size
        rows = list(self.rows)
        accepted = _advance(self.backend, self.cache, self.strategy, rows, s, self.stats)
        self.leave([r for r in rows if r.done])
        return [(r, new) for r, new in zip(rows, accepted) if new]

    def _drop_dead_keys(self) -> None:
        """Cache positions no remaining row attends (they belonged to rows that left) go once
        they are a quarter of the cache: the copy is paid rarely, the waste stays bounded."""
        kv = self.strategy.key_valid
        if kv is None or not kv.shape[1]:
            return
        live = kv.any(axis=0)
        if not live.any():
            # Only rows that have not taken a step yet remain: they own no entry; start afresh
            # (a cache with no entries could not gain a row by copying one).
            self.cache = self.backend.new_cache(len(self.rows))
            self.strategy.key_valid = None
            return
        if self.keep_keys is None or 4 * (kv.shape[1] - int(live.sum())) < kv.shape[1]:
            return
        columns = np.flatnonzero(live)
        self.keep_keys(self.cache, columns)
        self.strategy.key_valid = kv[:, columns]
