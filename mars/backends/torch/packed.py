"""Linear layers with their weights packed once, for multi-token forwards on the CPU.

On the CPU a forward of k > 1 new tokens runs every linear layer as a small matrix
product. The BLAS behind `F.linear` re-arranges (packs) the whole weight matrix for
such a product on every call, so a forward of 4 to 12 tokens costs 1.5-2.5x a
one-token forward whose weights are only read once. oneDNN can pack a weight once, in
advance, for any number of rows; a packed product then reads the weight as a one-token
forward does. `pack_linears` keeps each weight as it is and adds its packed copy
(the weights take twice the memory); a layer then runs:

- one row (a one-token forward: plain AR): `F.linear`, exactly today's path, so AR
  computes bit for bit what `transformers` computes;
- more rows: the packed product (oneDNN), unless the weight changed since it was
  packed (training), then `F.linear` again; two rows run as four (`PAD_ROWS`: zero rows
  added, their outputs dropped), which oneDNN computes faster. Which is faster for a few
  rows depends on the CPU: where `F.linear`'s own small products beat the packed one (on
  a Xeon with AVX-512, 2 and 3 rows cost 1.08x and 1.18x one row with `F.linear` against
  1.1-1.2x packed), those row counts run `F.linear` (`time_row_paths`,
  `use_linear_rows`: measured once per CPU and model shape by the torch decoder).

The packs are used only inside `active()`, which the torch decoder enters for its steps:
anything else that runs the same model (training, `model.generate`) computes as before.

Inside `real_rows(index, total)` (a batch's step with holes: rows that feed fewer tokens
than the widest, left padding), a packed layer given all `total` positions computes the
real ones alone (`index`) and returns zeros at the holes. Every linear layer acts on each
position alone, so the real positions' outputs are the same numbers; a hole's are never
attended nor read (docs/method.md §6). A batch's step then costs what its real tokens
cost, not rows x its widest row. The packed product's rows do not depend on how many rows
it runs (checked in the tests), so only a step left with one real row changes path.

A packed product sums in another order than `F.linear`'s, so its outputs can differ in
the last bits, as `F.linear`'s own k-row and one-row products already do. Lossless
decoding compares the argmax of a multi-token forward with the draft, so the text it
produces is the model's greedy AR text up to such near-ties; the exactness tests and
`mars bench` (its `=AR` column) check it.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Below this many rows `F.linear` runs. Measured on a 2-core x86 CPU, 1 thread, one
# 1536x576 fp32 layer: `F.linear` costs 112/207/328/208 us for 1/2/3/4 rows (2 and 3 rows
# run as separate one-row products), packed 98/102/109/121 us. One row stays on `F.linear`
# all the same: it is the AR step, whose outputs must equal `transformers`' bit for bit.
MIN_ROWS = 2
# Row counts the packed product runs faster with zero rows added. In the whole model (each
# weight read from memory, not from cache), oneDNN's 2-row product is slower than its 3- or
# 4-row one: on the default model (2-core x86, 1 thread, interleaved; medians over 25 rounds,
# then over 15) a 2-token forward cost 1.27x a one-token forward, 1.11x padded to 3 rows;
# 1.06x padded to 4 (3 and 4 tokens: 1.06-1.07x and 1.02-1.04x).
PAD_ROWS: dict[int, int] = {2: 4}
# Packed layers use their packs only inside `active()` (the decoder's steps), so a model
# shared with other code (training, a library's own generate) computes as it always did.
_enabled = False
# Inside `real_rows`: (flat indices of the real positions, all positions), and the last
# input gathered, with its version (the query, key and value projections share theirs).
_rows: tuple[torch.Tensor, int] | None = None
_gathered: tuple[torch.Tensor, int | None, torch.Tensor] | None = None


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing is a CPU feature of x86/arm builds with mkldnn."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if _rows is not None and rows == _rows[1] and _enabled:
        return _real_rows_forward(self, x)
    if (
        rows < MIN_ROWS
        or rows in self._mars_linear_rows
        or not _enabled
        or self.weight._version != self._mars_version
        or self.weight.requires_grad
        and torch.is_grad_enabled()
    ):
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    pad = PAD_ROWS.get(rows, rows) - rows
    if pad:  # a row count oneDNN runs slowly: run it with zero rows added, drop their outputs
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])
    y = torch.ops.mkldnn._linear_pointwise(flat, self._mars_packed, self.bias, "none", [None], "")
    if pad:
        y = y[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _real_rows_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The layer on the real positions of `x` alone, zeros at the holes (see `real_rows`)."""
    global _gathered
    index, total = _rows
    version = None if x.is_inference() else x._version  # inference tensors keep no version counter
    if _gathered is not None and _gathered[0] is x and _gathered[1] == version:
        real = _gathered[2]
    else:
        real = x.reshape(total, x.shape[-1]).index_select(0, index)
        _gathered = (x, version, real)
    y = _packed_forward(self, real)  # one real row runs F.linear, as AR does
    out = y.new_zeros(total, y.shape[-1])
    out.index_copy_(0, index, y)
    return out.reshape(*x.shape[:-1], y.shape[-1])


def pack_linears(module: torch.nn.Module) -> int:
    """Pack every `nn.Linear` inside `module` (in place); returns how many were packed.
    Layers already packed are re-packed (their weights may have changed)."""
    count = 0
    for layer in module.modules():
        if not isinstance(layer, torch.nn.Linear) or layer.weight.dtype not in PACKED_DTYPES:
            continue
        with torch.no_grad():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
            except RuntimeError:
                continue
        layer._mars_packed = packed
        layer._mars_version = layer.weight._version
        layer._mars_linear_rows = frozenset()
        layer.forward = types.MethodType(_packed_forward, layer)
        count += 1
    return count


@contextlib.contextmanager
def _switched(on: bool):
    global _enabled
    before, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = before


def active():
    """Packed layers use their packs inside this block (the decoder's forwards)."""
    return _switched(True)


@contextlib.contextmanager
def real_rows(index: torch.Tensor, total: int):
    """Packed layers given `total` positions compute only those at `index` (flat, sorted,
    at least one), with zeros elsewhere, inside this block (and `active()`)."""
    global _rows, _gathered
    before, _rows = _rows, (index, total)
    try:
        yield
    finally:
        _rows, _gathered = before, None


def disabled():
    """Packed layers run plain `F.linear` inside this block, even within `active()`."""
    return _switched(False)


def unpack_linears(module: torch.nn.Module) -> None:
    """Undo `pack_linears`: every layer runs `F.linear` again and the packed copies are freed."""
    for layer in module.modules():
        if "_mars_packed" in layer.__dict__:
            del layer.forward
            del layer._mars_packed
            del layer._mars_version
            del layer._mars_linear_rows


def packed_layers(module: torch.nn.Module) -> list[torch.nn.Linear]:
    return [layer for layer in module.modules() if "_mars_packed" in layer.__dict__]


def use_linear_rows(module: torch.nn.Module, rows) -> None:
    """Products of these row counts run `F.linear` in every packed layer of `module`."""
    for layer in packed_layers(module):
        layer._mars_linear_rows = frozenset(int(r) for r in rows)


def time_row_paths(module: torch.nn.Module, rows=(2, 3, 4), repeats: int = 5) -> dict[int, tuple[float, float]]:
    """Seconds of one pass over every packed layer of `module` (as a forward reads them, so
    the weights come from memory) with `rows` input rows: {rows: (F.linear, packed)},
    medians of `repeats` interleaved passes after a warm-up."""
    import statistics
    import time

    layers = packed_layers(module)
    if not layers:
        return {}
    first = layers[0].weight
    inputs = {}
    samples = {(r, path): [] for r in rows for path in ("linear", "packed")}
    saved = [layer._mars_linear_rows for layer in layers]
    try:
        with torch.no_grad(), _switched(True):
            for rep in range(repeats + 1):
                for r in rows:
                    for path in ("linear", "packed"):
                        for layer in layers:
                            layer._mars_linear_rows = frozenset({r}) if path == "linear" else frozenset()
                        t0 = time.perf_counter()
                        for layer in layers:
                            key = (r, layer.in_features)
                            if key not in inputs:
                                inputs[key] = torch.randn(r, layer.in_features, dtype=first.dtype, device=first.device)
                            layer(inputs[key])
                        if rep:
                            samples[(r, path)].append(time.perf_counter() - t0)
    finally:
        for layer, before in zip(layers, saved):
            layer._mars_linear_rows = before
    return {r: (statistics.median(samples[(r, "linear")]), statistics.median(samples[(r, "packed")])) for r in rows}


def faster_on_linear(timings: dict[int, tuple[float, float]], margin: float = 0.05) -> list[int]:
    """The row counts whose `F.linear` pass beat the packed one by more than `margin`."""
    return sorted(r for r, (linear, packed) in timings.items() if linear < (1 - margin) * packed)


def product(x: torch.Tensor, weight: torch.Tensor, bias, pack, linear_rows=frozenset()) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x` (rows, in), through `pack` (a packed copy of `weight`,
    or None) where the rules above say: 2 rows or more, not a row count that runs `F.linear` on
    this CPU, no gradient wanted; two rows run as four. The explicit form of a packed layer's
    forward, for mars's own forward (models/), which passes its layers' packs as arguments."""
    rows = x.shape[0]
    if pack is None or rows < MIN_ROWS or rows in linear_rows or (weight.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    pad = PAD_ROWS.get(rows, rows) - rows
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[-1])])
    y = torch.ops.mkldnn._linear_pointwise(x, pack, bias, "none", [None], "")
    return y[:rows] if pad else y
