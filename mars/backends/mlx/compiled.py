"""The MLX backend's decoding step under `mx.compile` (docs/design.md, "Compiled steps"): a cache of
fixed room, steps padded to a few widths, and one traced graph per shape.

An eager step on mlx-lm's KV caches pays MLX's graph building for every operation of every layer
on every step, and its cache grows by a concatenation of each layer's keys each step. Here:
- `StaticCache` (static_cache.py) holds each layer's keys and values in buffers of fixed room
  (grown by ROOM positions when a step would pass the end); a step writes its keys at the cached
  length, which reaches the graph as an array, not a number frozen into the trace; cropping sets
  the length.
- A step's width is padded to mars.core.masks.WIDTH_BUCKETS by holes (never attended, never read),
  so the graph meets few shapes: one per (rows, width bucket, room). The head runs after the graph,
  on the rows read, whose number varies.
- The attention mask (rows, width, room) is built inside the graph from the cached length and the
  step's StepMask arrays (every part, made where a step has none), as forward.step_mask builds it
  for the eager step; keys past the fed ones are never seen.
- For the llama family the graph runs mars's own forward (lean.py: fewer operations a layer);
  otherwise mlx-lm's modules (forward.hidden_states), so any architecture of the MLX table whose
  layers have no sliding window compiles; one with a sliding window runs the eager step.
- On a GPU a one-token greedy step that reads its own column (AR, a batch of rows that fed one token
  each) starts the next such step before its ids are read back: its argmax is that step's input, on
  the device, and `mx.async_eval` has the device run it while the host takes the step's verdict.
  When the loop then asks for exactly that step (the same ids, positions and length), its result is
  already there; otherwise it is dropped and nothing it wrote is kept. (On a CPU MLX evaluated the
  step mostly inline, and starting it ahead gained nothing: benchmarks/README.md.)

Arithmetic: the same operations as the eager step except attention, which spans the cache's whole
room with a mask (the eager step attends over the cached keys alone), and the lean forward's joined
products, so the logits may differ in their last bits and the tests compare tokens
(tests/test_mlx_compiled.py)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...core.masks import StepMask, bucket, pad_width
from .forward import Positions, body, columns_mask, head, hidden_states, layer_windows, to_device
from .lean import LeanForward, supports
from .static_cache import StaticCache, StaticLayer


def room_mask(at: mx.array, width: int, room: int, batch: int, keys, valid, see, start) -> mx.array:
    """A step's bool attention mask (batch, width, room) over the cache's whole room: `at` the cached
    length (an array), `keys` (batch, room) the real keys among the cached and fed ones (False past
    them), `valid` (batch, width) the real fed columns, `see` and `start` the StepMask's
    (forward.columns_mask, the eager step's rule). A key past the fed ones is never seen."""
    return columns_mask(mx.arange(room) - at, width, batch, keys, valid, see, start)


@dataclass
class Pending:
    """A step started ahead (the next AR step, from the last one's argmax on the device): what it
    was fed and what it gave; `host_ids`, its ids as the host read them back, once it has."""

    positions: np.ndarray
    length: int
    logits: mx.array
    keys: list[mx.array]
    values: list[mx.array]
    host_ids: np.ndarray | None = None


def consecutive(positions: np.ndarray) -> bool:
    """Whether each row's positions follow one another (a step's rotation then runs per row)."""
    return positions.shape[1] == 1 or bool((np.diff(positions, axis=1) == 1).all())


def compilable(model: nn.Module) -> bool:
    """Whether the compiled step serves this model: mlx-lm's layers and no sliding window."""
    return hasattr(body(model), "layers") and not any(layer_windows(model))


class CompiledMlxStep:
    """The MLX decoder's forward (MlxDecoder.logits) on a StaticCache, each step's graph traced once
    per shape by `mx.compile` (the prompt's step, on an empty cache, runs the same forward eager).
    `traces`: the graphs traced so far (tests count them); `ahead`: steps started ahead and taken."""

    def __init__(self, model: nn.Module, gate=None, ahead: bool | None = None):
        self.model = model
        self.gate = gate
        # Start AR steps ahead where the device runs beside the host: a GPU. (MLX's CPU stream ran a
        # compiled step's evaluation mostly inline: started ahead, AR steps were no faster there.)
        self.start_ahead = mx.default_device() == mx.gpu if ahead is None else ahead
        # mars's own forward where it runs the model (not gated: a gate adapts its projections).
        self.lean = LeanForward.of(model) if gate is None and supports(model) is None else None
        self.traces = 0
        self.ahead = 0
        self.pending: Pending | None = None
        # The weights are the graph's inputs, read at every call (mlx-lm's convention for model state).
        state = [model.state] + ([self.lean.state] if self.lean is not None else [])
        self._graph = mx.compile(self._traced, inputs=state)

    def new_cache(self) -> StaticCache:
        self.pending = None
        return StaticCache()

    # The cache's changes between steps (MlxDecoder's crop, keep_rows, keep_keys): a step started
    # ahead was fed the cache as it was, so any change that touches what it saw drops it.
    def crop(self, cache: StaticCache, length: int) -> None:
        if length < cache.length:
            self.pending = None
        cache.crop(length)

    def keep_rows(self, cache: StaticCache, rows: list[int]) -> None:
        self.pending = None
        cache.keep_rows(rows)

    def keep_keys(self, cache: StaticCache, columns) -> None:
        self.pending = None
        cache.keep_keys(columns)

    def _traced(self, *args):
        self.traces += 1  # Python runs this once per trace
        return self._forward(*args)

    def _forward(self, ids, positions, at, masks: dict, keys, values, room: int, consecutive: bool):
        """The step: hidden states over the static cache; returns them and the layers' buffers with
        the step's keys written. (The head, on the rows read, runs after it: their number varies.)"""
        if self.gate is not None:
            self.gate.set(ids)
        b, w = ids.shape
        allowed = masks.get("dense")
        if allowed is None:
            get = masks.get
            allowed = room_mask(at, w, room, b, get("keys"), get("valid"), get("see"), get("start"))
        if self.lean is not None:
            return self.lean(ids, positions, allowed, at, keys, values, room, consecutive)
        n = len(body(self.model).layers)
        layers = [StaticLayer(k, v, at, room) for k, v in zip(keys or [None] * n, values or [None] * n)]
        h = hidden_states(self.model, ids, Positions(positions), allowed[:, None], layers)
        return h, [c.keys for c in layers], [c.values for c in layers]

    @staticmethod
    def _masks(mask, b: int, cached: int, width: int, room: int) -> dict:
        """A step's mask as the graph takes it: a StepMask (None: plain causal) as its arrays, every
        one of them always (one graph for every kind of step), its keys over the whole room; a dense
        mask (b, width, cached + width) widened to the room."""
        if isinstance(mask, StepMask) or mask is None:
            mask = mask or StepMask(cached, width)
            keys = np.zeros((b, room), dtype=bool)
            keys[:, : cached + width] = True if mask.keys is None else mask.keys
            own = np.broadcast_to(np.arange(width), (b, width))
            # Plain causal (None): every column up to its own.
            see = own if mask.see is None else np.asarray(mask.see, dtype=np.int64)
            start = own if mask.start is None else np.asarray(mask.start, dtype=np.int64)
            return dict(keys=keys, valid=keys[:, cached : cached + width], see=see, start=start)
        dense = np.zeros((b, width, room), dtype=bool)
        dense[:, :, : cached + width] = mask
        return dict(dense=dense)

    def _head(self, h: mx.array, read: mx.array) -> mx.array:
        return head(self.model, mx.take_along_axis(h, read[..., None], axis=1))

    def logits(self, cache: StaticCache, input_ids, positions, mask, read, more: dict):
        """One forward of `input_ids` at `positions` under `mask` (None, a StepMask, or a dense bool
        (b, q, cached + q)) on `cache`: (the logits of the `read` columns, the `more` arrays on the
        device). Its host inputs travel in one copy (forward.to_device)."""
        positions = np.asarray(positions)
        input_ids = np.asarray(input_ids)
        read = np.asarray(read)
        b, q = input_ids.shape
        cached = cache.length
        pending, self.pending = self.pending, None
        if (
            pending is not None
            and pending.host_ids is not None
            and not more
            and mask is None
            and cached == pending.length
            and np.array_equal(input_ids, pending.host_ids)
            and np.array_equal(positions, pending.positions)
            and read.shape == (b, 1)
            and not read.any()
        ):
            self.ahead += 1
            cache.keys, cache.values, cache.length = pending.keys, pending.values, cached + 1
            return pending.logits, {}
        eager = cache.keys is None  # a cache's first step (a prompt's) runs eager, unpadded
        width = q if eager else bucket(q)
        ids, pos, padded, _ = pad_width(input_ids, positions, mask, None, cached, width)
        room = cache.reserve(cached + width)
        masks = self._masks(padded, b, cached, width, room)
        sent = to_device(ids=ids, positions=pos, read=read, at=np.array([cached]), **masks, **more)
        args = (sent["ids"], sent["positions"], sent["at"], {k: sent[k] for k in masks})
        forward = self._forward if eager else self._graph
        h, cache.keys, cache.values = forward(*args, cache.keys, cache.values, room, consecutive(positions))
        cache.length = cached + q
        return self._head(h, sent["read"]), {name: sent[name] for name in more}

    def start_next(self, cache: StaticCache, chosen: mx.array, positions) -> None:
        """Start the next one-token step ahead: `chosen` (rows, 1), the last step's argmax on the
        device, fed one position past `positions` at the cached length. Its logits and buffers wait
        in `pending` (evaluated meanwhile) for the loop's next call; `taken(ids)` then tells it what
        the host read back."""
        positions = np.asarray(positions)[:, -1:] + 1
        cached = cache.length
        b = chosen.shape[0]
        if cache.keys is None or cache.room < cached + 1:
            return  # the next step grows the room: not started ahead
        masks = self._masks(None, b, cached, 1, cache.room)
        sent = to_device(positions=positions, read=np.zeros((b, 1), dtype=np.int64), at=np.array([cached]), **masks)
        ids = chosen.reshape(b, 1).astype(mx.int32)
        graph_masks = {k: sent[k] for k in masks}
        h, keys, values = self._graph(
            ids, sent["positions"], sent["at"], graph_masks, cache.keys, cache.values, cache.room, True
        )
        logits = self._head(h, sent["read"])
        mx.async_eval(logits, keys, values)
        self.pending = Pending(positions, cached, logits, keys, values)

    def taken(self, ids: np.ndarray) -> None:
        """The ids the last step chose, read back: the step started ahead was fed these."""
        if self.pending is not None:
            self.pending.host_ids = np.asarray(ids).reshape(-1, 1)
