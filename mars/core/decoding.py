"""The decoding loop (METHOD §5-6): one loop, small strategies that say what to feed and commit.

Per step the strategy lays out what every row feeds on top of its committed cache,
the backend runs one forward and returns per-slot (id, confidence) on the host,
the acceptance rule decides how many leading slots each row keeps, and the
strategy commits: it tells the backend how far to crop the cache.

Rows of a batch share one cache length. Rows that fed fewer tokens than others
leave holes: keys nobody attends (`key_valid` False), so every row sees exactly
the sequence it would see alone, at its own positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .acceptance import accept_counts, check_metric, is_ar_mode
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

    def __post_init__(self):
        check_metric(self.metric)
        if self.cache not in STRATEGIES:
            raise ValueError(f"cache must be one of {', '.join(STRATEGIES)}, got {self.cache!r}")
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        if self.block_cache < 1:
            raise ValueError(f"block cache size must be >= 1, got {self.block_cache}")
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {self.max_tokens}")

    @property
    def masks_per_step(self) -> int:
        # In AR mode the masks could never be accepted: feed none (a one-slot window).
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


@dataclass
class Feed:
    ids: np.ndarray  # (b, q) int64
    positions: np.ndarray  # (b, q) int64
    valid: np.ndarray  # (b, q) bool: False for holes
    read: np.ndarray  # (b, k) indices into q: slot j of row r is read at read[r, j]
    limit: np.ndarray  # (b,) tokens row r may accept this step; 0 = it waits


@dataclass
class RowStats:
    forwards: int = 0  # forwards that produced at least one token for this row
    waited: int = 0  # forwards in which the row was unfinished but took nothing
    accepted: int = 0
    accepted_per_slot: list[int] = field(default_factory=list)

    @property
    def tokens_per_forward(self) -> float:
        return self.accepted / self.forwards if self.forwards else 0.0


@dataclass
class DecodeStats:
    rows: list[RowStats]
    forwards: int = 0  # batch forwards run
    fed_tokens: int = 0  # token slots fed, holes included (the compute spent)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rows)

    @property
    def row_forwards(self) -> int:
        return sum(r.forwards for r in self.rows)

    @property
    def tokens_per_forward(self) -> float:
        """Accepted tokens / counted forwards, summed over rows (METHOD §5, Counting)."""
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
                }
                for r in self.rows
            ],
        }


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # generated ids per row, an accepted EOS included
    finish: list[str]  # "eos" or "length"
    stats: DecodeStats


class _Row:
    def __init__(self, prompt: list[int], slots: int):
        self.seq = list(prompt)  # prompt + accepted output
        self.prompt_len = len(prompt)
        self.cached = 0  # real tokens of `seq` already in the cache
        self.done = False
        self.finish = ""
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


def _positions(valid: np.ndarray, first: list[int]) -> np.ndarray:
    """Consecutive positions over each row's valid slots, starting at first[r]; holes get 0."""
    pos = np.cumsum(valid, axis=1) - 1 + np.asarray(first, dtype=np.int64)[:, None]
    return np.where(valid, pos, 0)


class WindowStrategy:
    """Sliding window (METHOD §5-6): feed what is not yet cached, then B masks.

    With `cached=False` nothing is kept: every step feeds the whole sequence.
    With `cached=True` the cache keeps committed tokens only; mask entries are cropped.
    """

    def __init__(self, settings: DecodeSettings, cached: bool):
        self.s = settings
        self.cached = cached
        self.key_valid: np.ndarray | None = None  # (b, cache_len) for the cached variant

    def plan(self, rows: list[_Row]) -> Feed:
        m = self.s.masks_per_step
        parts = [[] if r.done else r.seq[r.cached :] for r in rows]
        masks = [0 if r.done else m for r in rows]
        width = max(len(p) for p in parts) + m
        ids, valid = _right_aligned(parts, width, self.s.mask_id, masks)
        read = np.tile(np.arange(width - m - 1, width), (len(rows), 1))
        limit = [0 if r.done else min(m + 1, self.s.max_tokens - len(r.out)) for r in rows]
        return Feed(ids, _positions(valid, [r.cached for r in rows]), valid, read, np.asarray(limit))

    def keys(self, feed: Feed) -> np.ndarray:
        if not self.cached or self.key_valid is None:
            return feed.valid
        return np.concatenate([self.key_valid, feed.valid], axis=1)

    def commit(self, backend, cache, rows: list[_Row], feed: Feed, before: list[int]) -> None:
        if not self.cached:
            return
        # Keep the real tokens just fed; the masks' keys were computed from MASK and go.
        fed_real = feed.ids.shape[1] - self.s.masks_per_step
        old = 0 if self.key_valid is None else self.key_valid.shape[1]
        self.key_valid = self.keys(feed)[:, : old + fed_real]
        backend.crop(cache, self.key_valid.shape[1])
        for r, b in zip(rows, before):
            r.cached = b


class BlockStrategy:
    """Block-level cache for batches (METHOD §6).

    Rows stay aligned on blocks of B_cache generated tokens. Inside a block every
    step feeds the block's slots (filled ones real, the rest masks) on the
    block-start cache; a row that filled its block waits. The finished block is
    committed by feeding it in front of the next block's first step, and the
    prompt in front of the first block's, so no forward is spent on commits alone.
    """

    def __init__(self, settings: DecodeSettings):
        self.s = settings
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
        blk_ids = np.full((len(rows), size), s.mask_id, dtype=np.int64)
        blk_valid = np.zeros((len(rows), size), dtype=bool)
        for i, (r, start, f) in enumerate(zip(rows, self.block_start, fill)):
            if not waiting[i]:
                blk_ids[i, :f] = r.seq[start:]
                blk_valid[i] = True
        ids = np.concatenate([fold_ids, blk_ids], axis=1)
        valid = np.concatenate([fold_valid, blk_valid], axis=1)
        positions = _positions(valid, [r.cached for r in rows])
        slots = s.masks_per_step + 1
        base = width_fold + np.asarray(fill)[:, None] - 1
        read = np.clip(base + np.arange(slots)[None, :], 0, ids.shape[1] - 1)
        limit = [
            0 if w else min(slots, size - f, s.max_tokens - len(r.out)) for r, f, w in zip(rows, fill, waiting)
        ]
        self._fold_width = width_fold
        return Feed(ids, positions, valid, read, np.asarray(limit))

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
        size = self.s.block_cache
        if all(r.done or len(r.seq) - start >= size for r, start in zip(rows, self.block_start)):
            self.block_start = [len(r.seq) for r in rows]


def _strategy(settings: DecodeSettings):
    if settings.cache == "block":
        return BlockStrategy(settings)
    return WindowStrategy(settings, cached=settings.cache == "window")


def generate(
    backend: StepBackend,
    prompts: list[list[int]],
    settings: DecodeSettings,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> DecodeResult:
    """Decode every prompt; `on_tokens(row, ids)` sees each row's tokens as they are accepted."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    s = settings
    slots = s.masks_per_step + 1
    rows = [_Row(p, slots) for p in prompts]
    strategy = _strategy(s)
    cache = None if s.cache == "none" else backend.new_cache(len(rows))
    stats = DecodeStats(rows=[r.stats for r in rows])
    eos = set(s.eos_ids)
    # Greedy AR accepts slot 0 by rule: no confidence is needed, so none is computed.
    step_metric = None if is_ar_mode(s.metric, s.threshold) and s.sampling.greedy else s.metric

    while not all(r.done for r in rows):
        feed = strategy.plan(rows)
        keys = strategy.keys(feed)
        mask = None if keys.all() else decode_mask(keys, feed.ids.shape[1])
        ids, conf = backend.step(
            cache, feed.ids, feed.positions, mask, feed.read, metric=step_metric, sampling=s.sampling
        )
        stats.forwards += 1
        stats.fed_tokens += feed.ids.size
        counts = accept_counts(conf, s.metric, s.threshold, feed.limit)
        # What each row had fed for real: the cached variants commit it.
        before = [len(r.seq) if not r.done else r.cached for r in rows]
        for i, r in enumerate(rows):
            if r.done:
                continue
            if counts[i] == 0:
                r.stats.waited += 1
                continue
            new = [int(t) for t in ids[i, : counts[i]]]
            for j, t in enumerate(new):
                if t in eos:
                    new = new[: j + 1]
                    r.done, r.finish = True, "eos"
                    break
            r.seq.extend(new)
            r.stats.forwards += 1
            r.stats.accepted += len(new)
            for j in range(len(new)):
                r.stats.accepted_per_slot[j] += 1
            if not r.done and len(r.out) >= s.max_tokens:
                r.done, r.finish = True, "length"
            if on_tokens is not None:
                on_tokens(i, new)
        strategy.commit(backend, cache, rows, feed, before)

    return DecodeResult(tokens=[r.out for r in rows], finish=[r.finish for r in rows], stats=stats)
