"""The decoding loop (docs/method.md §5-6, §8-9): per step (mars.core.decode.step) the step is decided
(the feed, the drafts, the strategy's layout of what every row feeds on its committed cache), the
backend runs one forward, the mode decides what each row keeps (mars.core.decode.verify), the rows
take it, and the strategy commits and crops the cache.

Rows of a batch share one cache length: a row that fed fewer tokens than others leaves holes, keys
nobody attends, so every row sees exactly the sequence it would see alone, at its own positions.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..acceptance import check_threshold
from .execution import Execution, execution
from .feed import FeedController
from .plan import Plan
from .step import apply, decide, run_step
from .strategies import BlockStrategy, WindowStrategy, make_strategy
from .types import DecodeResult, DecodeStats, Row, StepBackend


def generate(
    backend: StepBackend,
    prompts: list[list[int]],
    settings: Plan,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    controller: FeedController | None = None,
) -> DecodeResult:
    """Decode every prompt; `on_tokens(row, ids)` sees each row's tokens as they are accepted.

    With `controller` (the model's FeedController) and `settings.feed` "auto", each step's feed is
    chosen from the cost curves and the block cache gives way to the window cache where it does not
    pay (`stats.cache` says which ran; mars.core.decode.execution). Lossless output is the same
    either way; threshold-mode text may differ from a fixed feed's."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    slots = settings.masks_per_step + 1
    rows = [Row(p, slots, threshold=settings.threshold, max_tokens=settings.max_tokens) for p in prompts]
    run = execution(settings, controller, len(rows))
    s = run.plan
    stats = DecodeStats(rows=[r.stats for r in rows], cache=s.cache)
    strategy = make_strategy(s, rows)
    cache = backend.new_cache(len(rows))  # also resets the backend's per-row state
    if s.cache == "none":
        cache = None

    live = list(range(len(rows)))  # rows still in the batch (finished ones are dropped in bulk)
    everyone = rows
    while live:
        rows = [everyone[i] for i in live]
        accepted = _advance(backend, cache, strategy, rows, run, stats)
        if on_tokens is not None:
            for i, new in enumerate(accepted):
                if new:
                    on_tokens(live[i], new)
        live = _compact(backend, cache, strategy, rows, live)

    rows = everyone
    run.report(stats)
    logprobs = [r.logprobs for r in rows] if s.logprobs is not None else None
    return DecodeResult(tokens=[r.out for r in rows], finish=[r.finish for r in rows], stats=stats, logprobs=logprobs)


def _advance(backend, cache, strategy, rows: list[Row], run: Execution, stats: DecodeStats) -> list[list[int]]:
    """One forward of the loop (mars.core.decode.step): decided, run, applied, committed; returns the
    tokens each row took (none if it waited)."""
    spec = decide(run, strategy, rows, stats)
    outcome = run_step(backend, cache, spec, run, rows)
    accepted, before = apply(outcome, spec, rows, run, stats)
    kept = outcome.verdict.kept if outcome.verdict is not None else None
    strategy.commit(backend, cache, rows, spec.layout, before, kept)
    return accepted


def _compact(backend, cache, strategy, rows: list[Row], live: list[int]) -> list[int]:
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
    """Decoding for a server: rows join and leave while the batch runs, each at its own threshold
    (which the caller may change between steps) and max_tokens. Lossless mode and sampling belong to
    the batch, since a backend step samples every row alike.

    On the block cache (docs/method.md §6) a row joins only at a block boundary (`can_join`), so its
    blocks start where its prompt ends, as when decoded alone. On the window cache a row joins at any
    step, its whole prompt fed beside the other rows' tokens and the cached keys holes to it; a greedy
    lossless row's tokens are its AR tokens whatever else is in the batch.

    `keep_keys(cache, columns)`, when given, keeps only those cache positions of every layer, so a
    batch that never empties keeps a bounded cache."""

    def __init__(
        self,
        backend: StepBackend,
        settings: Plan,
        keep_keys: Callable[[Any, np.ndarray], None] | None = None,
        controller: FeedController | None = None,
    ):
        if settings.cache not in ("block", "window"):
            raise ValueError(f"a served batch keeps a cache: cache 'block' or 'window', not {settings.cache!r}")
        self.backend = backend
        self.run = execution(settings, controller, 1, served=True)
        self.s = self.run.plan
        self._stats = DecodeStats(rows=[], cache=self.s.cache)
        self.keep_keys = keep_keys
        self.rows: list[Row] = []
        self.window = self.s.cache == "window"
        self.strategy = self._new_strategy()
        self.cache = None

    def _new_strategy(self):
        return WindowStrategy(self.s, cached=True) if self.window else BlockStrategy(self.s)

    @property
    def stats(self) -> DecodeStats:
        """The batch's forwards and fed tokens (rows keep their own), with the drafting statistics now."""
        self.run.report(self._stats)
        return self._stats

    @property
    def can_join(self) -> bool:
        """Always on the window cache; on the block cache, while no row has filled a slot of its block."""
        return self.window or all(len(r.seq) == start for r, start in zip(self.rows, self.strategy.block_start))

    @property
    def cache_width(self) -> int:
        """Positions the batch's cache holds (0 when it holds none)."""
        kv = self.strategy.key_valid
        return 0 if kv is None else int(kv.shape[1])

    def join(self, prompt: list[int], *, threshold: float | None = None, max_tokens: int | None = None) -> Row:
        """Add a row (only when `can_join`), decoded from the next step on. Returns the row, whose
        `out`, `done`, `finish`, `stats` and `threshold` the caller reads, and may set `threshold`."""
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if not self.can_join:
            raise RuntimeError("rows join at block boundaries: wait until can_join")
        s = self.s
        row = Row(
            prompt,
            s.block_size + 1,
            threshold=s.threshold if threshold is None else check_threshold(s.metric, threshold),
            max_tokens=s.max_tokens if max_tokens is None else max_tokens,
        )
        if not self.rows:
            self.strategy = self._new_strategy()
            self.cache = self.backend.new_cache(1)
        else:
            # The new row's entries copy row 0's; they are holes to it, never attended.
            self.backend.keep_rows(self.cache, list(range(len(self.rows))) + [0])
        self.strategy.add_row(row)
        self.rows.append(row)
        return row

    def leave(self, rows: list[Row]) -> None:
        """Remove rows (finished or not) from the batch at once."""
        gone = {id(r) for r in rows}
        keep = [j for j, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[j] for j in keep]
        if not self.rows:
            self.strategy = self._new_strategy()
            self.cache = None
            return
        self.backend.keep_rows(self.cache, keep)
        self.strategy.keep_rows(keep)
        if not self.window:
            self.strategy.next_block_if_filled(self.rows)
        self._drop_dead_keys()

    def step(self) -> list[tuple[Row, list[int]]]:
        """One forward for every row; returns (row, tokens) for the rows that took tokens.
        Rows that finished in this step have left the batch when it returns."""
        if not self.rows:
            return []
        rows = list(self.rows)
        accepted = _advance(self.backend, self.cache, self.strategy, rows, self.run, self._stats)
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
