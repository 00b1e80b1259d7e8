"""Linear layers with their weights packed once, for multi-token forwards on the CPU.

On the CPU a forward of k > 1 new tokens runs every linear layer as a small matrix
product. The BLAS behind `F.linear` re-arranges (packs) the whole weight matrix for
such a product on every call, so a forward of 4 to 12 tokens costs 1.5-2.5x a
one-token forward whose weights are only read once. oneDNN can pack a weight once, in
advance, for any number of rows; a packed product then reads the weight as a one-token
forward does. `pack_linears` keeps each weight as it is and adds its packed copy
(the weights take twice the memory); `linear(layer, x)`, which mars's own forward
(models/) calls for each of its products, then runs:

- one row (a one-token forward: plain AR): `F.linear`, exactly today's path, so AR
  computes bit for bit what `transformers` computes;
- more rows: the packed product (oneDNN), unless the weight changed since it was
  packed (training), then `F.linear` again; two rows run as four (`PAD_ROWS`: zero rows
  added, their outputs dropped), which oneDNN computes faster. Which is faster for a few
  rows depends on the CPU: where `F.linear`'s own small products beat the packed one (on
  a Xeon with AVX-512, 2 and 3 rows cost 1.08x and 1.18x one row with `F.linear` against
  1.1-1.2x packed), those row counts run `F.linear` (`time_row_paths`, `row_choices`,
  `use_linear_rows`: 2-4, 8, 16 and 32 rows measured once per CPU and model shape by the
  torch decoder, the counts between chosen as the next measured one). A narrow model's
  small layers lose to oneDNN's per-call toll at every row count (hidden 64: 27 us a packed
  product of 9 rows against 13 for `F.linear`), and then run `F.linear` throughout.

The layers' own `forward` is left alone: anything else that runs the same model (training,
`model.generate`, transformers' modules for the architectures without mars's forward)
computes as before.

A batch's step with holes (rows that feed fewer tokens than the widest, left padding) gives
the layers its real positions alone (models.StepInputs.real): every linear layer acts on
each position alone, and a hole's outputs are never attended nor read (docs/method.md §6),
so the step costs what its real tokens cost, not rows x its widest row. The packed
product's rows do not depend on how many rows it runs (checked in the tests), so the real
positions' outputs are the numbers the whole step would give; only a step left with one
real row changes path.

A packed product sums in another order than `F.linear`'s, so its outputs can differ in
the last bits, as `F.linear`'s own k-row and one-row products already do. Lossless
decoding compares the argmax of a multi-token forward with the draft, so the text it
produces is the model's greedy AR text up to such near-ties; the exactness tests and
`mars bench` (its `=AR` column) check it.
"""

from __future__ import annotations

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


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing is a CPU feature of x86/arm builds with mkldnn."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for `x` (rows, in), through the layer's pack (`pack_linears`) where the rules above
    say: 2 rows or more, not a row count that runs `F.linear` on this CPU (`use_linear_rows`), the
    weight unchanged since it was packed, no gradient wanted; two rows run as four."""
    rows = x.shape[0]
    pack = layer.__dict__.get("_mars_packed")
    if (
        pack is None
        or rows < MIN_ROWS
        or rows in layer._mars_linear_rows
        or layer.weight._version != layer._mars_version
        or (layer.weight.requires_grad and torch.is_grad_enabled())
    ):
        return F.linear(x, layer.weight, layer.bias)
    pad = PAD_ROWS.get(rows, rows) - rows
    if pad:  # a row count oneDNN runs slowly: run it with zero rows added, drop their outputs
        x = torch.cat([x, x.new_zeros(pad, x.shape[-1])])
    y = torch.ops.mkldnn._linear_pointwise(x, pack, layer.bias, "none", [None], "")
    return y[:rows] if pad else y


def _packed_product(x: torch.Tensor, pack: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The packed product as one operation a compiled graph calls as it is (inductor has no lowering
    of oneDNN's own for a pack given as an input): `out_features` gives its output's shape."""
    return torch.ops.mkldnn._linear_pointwise(x, pack, bias, "none", [None], "")


# mars.backends.torch.models.CompiledStep's wide graphs call it (torch.library.custom_op: torch >= 2.4).
packed_product = torch.library.custom_op("mars::packed_product", _packed_product, mutates_args=())


@packed_product.register_fake
def _(x, pack, bias, out_features):
    return x.new_empty((x.shape[0], out_features))


def graph_packs(layers: list[torch.nn.Linear]) -> bool:
    """Whether a compiled graph of products of 2 rows or more should run these layers' packs: they
    have them, and most row counts run packed on this CPU (`use_linear_rows`; one graph serves
    every count, so one path serves them all)."""
    packed = [layer for layer in layers if "_mars_packed" in layer.__dict__]
    return bool(packed) and 2 * len(packed[0]._mars_linear_rows) < CHOSEN_ROWS - MIN_ROWS + 1


def pack_linears(module: torch.nn.Module) -> int:
    """Pack every `nn.Linear` inside `module` (in place, beside its weight); returns how many were
    packed. Layers already packed are re-packed (their weights may have changed)."""
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
        count += 1
    return count


def pack_head(head: torch.nn.Module) -> bool:
    """Pack a float32 model's LM head (its own `nn.Linear`: forward.FinalLogits wraps it) for reads of
    2 rows or more (base.head_logits); whether it was packed.

    The head is the largest product of a small model's step (49,152 x 576 on the default model, 113
    MB in float32), and `F.linear` reads it poorly for a few rows. Measured on a 2-core x86 CPU, 1
    thread, that matrix alone: `F.linear` 22/34/17/21/34/35 ms for 2/3/4/9/17/33 rows, packed 8.6
    (2 rows run as 4: 6.0)/7.1/6.0/8.1/12.0/19.8 ms; one row, 9.9 ms, stays on `F.linear` (AR's own
    logits). bfloat16 keeps `F.linear`: its logits are rounded to 8 bits, where another summation
    order turns near-ties into other tokens more often (not measured)."""
    inner = head_layer(head)
    if type(inner) is not torch.nn.Linear or inner.weight.dtype != torch.float32:
        return False
    return pack_linears(inner) == 1


def head_layer(head: torch.nn.Module) -> torch.nn.Module:
    """The model's own LM head layer (forward.FinalLogits wraps it), where pack_head keeps its pack."""
    return getattr(head, "head", head)


def head_packed(head: torch.nn.Module) -> bool:
    return "_mars_packed" in head_layer(head).__dict__


def unpack_linears(module: torch.nn.Module) -> None:
    """Undo `pack_linears`: the packed copies are freed."""
    for layer in module.modules():
        for name in ("_mars_packed", "_mars_version", "_mars_linear_rows"):
            layer.__dict__.pop(name, None)


def packed_layers(module: torch.nn.Module) -> list[torch.nn.Linear]:
    return [layer for layer in module.modules() if "_mars_packed" in layer.__dict__]


def use_linear_rows(module: torch.nn.Module, rows) -> None:
    """Products of these row counts run `F.linear` in every packed layer of `module`."""
    for layer in packed_layers(module):
        layer._mars_linear_rows = frozenset(int(r) for r in rows)


# The row counts whose two paths the decoder times (time_row_paths), and the most rows a choice
# covers (row_choices): a product of more rows runs packed.
MEASURED_ROWS = (2, 3, 4, 8, 16, 32)
CHOSEN_ROWS = 64


def time_row_paths(module: torch.nn.Module, rows=MEASURED_ROWS, repeats: int = 5) -> dict[int, tuple[float, float]]:
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
    with torch.no_grad():
        for rep in range(repeats + 1):
            for r in rows:
                for path in ("linear", "packed"):
                    t0 = time.perf_counter()
                    for layer in layers:
                        key = (r, layer.in_features)
                        if key not in inputs:
                            inputs[key] = torch.randn(r, layer.in_features, dtype=first.dtype, device=first.device)
                        if path == "linear":
                            F.linear(inputs[key], layer.weight, layer.bias)
                        else:
                            torch.ops.mkldnn._linear_pointwise(
                                inputs[key], layer._mars_packed, layer.bias, "none", [None], ""
                            )
                    if rep:
                        samples[(r, path)].append(time.perf_counter() - t0)
    return {r: (statistics.median(samples[(r, "linear")]), statistics.median(samples[(r, "packed")])) for r in rows}


def faster_on_linear(timings: dict[int, tuple[float, float]], margin: float = 0.05) -> list[int]:
    """The row counts whose `F.linear` pass beat the packed one by more than `margin`."""
    return sorted(r for r, (linear, packed) in timings.items() if linear < (1 - margin) * packed)


def row_choices(timings: dict[int, tuple[float, float]], margin: float = 0.05) -> list[int]:
    """Every row count from 2 to CHOSEN_ROWS that runs `F.linear`: a measured count as measured
    (`faster_on_linear`), another as the next measured count above it (above them all: the
    largest). Small layers (a narrow model) lose to oneDNN's per-call toll at any row count;
    large ones gain from the pack from a few rows on."""
    if not timings:
        return []
    measured = sorted(timings)
    linear = set(faster_on_linear(timings, margin))
    out = []
    for r in range(MIN_ROWS, CHOSEN_ROWS + 1):
        like = next((m for m in measured if m >= r), measured[-1])
        if like in linear:
            out.append(r)
    return out
