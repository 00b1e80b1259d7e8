"""The MLX compiled step's KV cache (compiled.CompiledMlxStep): per layer its keys and values in
buffers of fixed room, written at the cached length given as an array, so that a traced graph
meets one shape however long the cache grows within its room."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# A new cache's room, and the step its room grows by.
ROOM = 256


class StaticLayer:
    """One layer's buffers as an mlx-lm attention layer sees its cache inside a step: the step's keys
    and values written at `at` (the cached length, an array), the whole room returned. A cache's
    first step (eager) allocates them, `room` positions, from its keys' shape."""

    def __init__(self, keys: mx.array | None, values: mx.array | None, at: mx.array, room: int):
        self.keys, self.values, self.at, self.room = keys, values, at, room

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = write(self.keys, keys, self.at, self.room)
        self.values = write(self.values, values, self.at, self.room)
        return self.keys, self.values


def write(buffer: mx.array | None, fresh: mx.array, at: mx.array, room: int) -> mx.array:
    """`fresh` (rows, heads, width, head dim) written into `buffer` (rows, heads, room, head dim) at
    `at`; None: a buffer of `room` positions is made for it."""
    if buffer is None:
        b, heads, _, dim = fresh.shape
        buffer = mx.zeros((b, heads, room, dim), dtype=fresh.dtype)
    if fresh.dtype != buffer.dtype:
        fresh = fresh.astype(buffer.dtype)
    return mx.slice_update(buffer, fresh, at, axes=(2,))


class StaticCache:
    """A batch's KV cache of fixed room: per layer its keys and values (rows, kv heads, room, head
    dim), allocated by the first step, and `length`, the positions cached (the host's count)."""

    key_positions = None  # no sliding window: forward.sliding_keys has nothing to keep
    eager = None  # the mlx-lm caches that serve it once the compiled step is dropped (MlxDecoder._eager)

    def __init__(self):
        self.keys: list[mx.array] | None = None
        self.values: list[mx.array] | None = None
        self.length = 0

    @property
    def room(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def _each(self, change) -> None:
        self.keys = [change(x) for x in self.keys]
        self.values = [change(x) for x in self.values]

    def reserve(self, needed: int) -> int:
        """Room for `needed` positions (grown by ROOM at a time, the cached keys kept); the room."""
        room = -(-needed // ROOM) * ROOM
        if self.keys is None or self.room >= needed:
            return max(room, self.room)
        more = room - self.room
        self._each(lambda x: mx.concatenate([x, mx.zeros(x.shape[:2] + (more, x.shape[3]), dtype=x.dtype)], axis=2))
        return room

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def keep_rows(self, rows: list[int]) -> None:
        if self.keys is not None:
            idx = mx.array(rows, dtype=mx.int32)
            self._each(lambda x: x[idx])

    def keep_keys(self, columns) -> None:
        """Keep only these cached positions, in this order, at the front of the room."""
        if self.keys is None:
            return
        idx = mx.array(np.asarray(columns, dtype=np.int32))
        pad = self.room - len(columns)

        def kept(x):
            x = mx.take(x, idx, axis=2)
            return mx.concatenate([x, mx.zeros(x.shape[:2] + (pad, x.shape[3]), dtype=x.dtype)], axis=2)

        self._each(kept)
        self.length = len(columns)
