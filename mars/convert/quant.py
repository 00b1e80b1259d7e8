"""mlx-lm affine quantization: dequantizing with numpy, quantizing through mlx (its own rounding)."""

from __future__ import annotations

import numpy as np

from ..checkpoint.tensors import ConvertError, Tensor, from_float32, to_float32

BITS = (2, 3, 4, 5, 6, 8)  # the affine widths mlx packs; each value little-endian in a uint32 stream
GROUP_SIZES = (32, 64, 128)  # the affine group sizes mlx quantizes with


def unpack(packed: np.ndarray, bits: int, columns: int) -> np.ndarray:
    """(rows, columns) integers from (rows, columns * bits / 32) uint32 words."""
    rows = packed.shape[0]
    if bits in (2, 4, 8):  # whole values per word: shifts are enough
        per = 32 // bits
        words = packed.astype(np.uint32)[:, :, None]
        shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
        return ((words >> shifts) & ((1 << bits) - 1)).reshape(rows, -1)[:, :columns].astype(np.uint8)
    stream = np.unpackbits(packed.astype("<u4").view(np.uint8).reshape(rows, -1), axis=1, bitorder="little")
    stream = stream[:, : columns * bits].reshape(rows, columns, bits)
    return (stream.astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(-1).astype(np.uint8)


def dequantize(name: str, weight: Tensor, scales: Tensor, biases: Tensor, bits: int, group_size: int) -> Tensor:
    """w = scales * q + biases per group along the last axis, in the scales' float type."""
    if bits not in BITS:
        raise ConvertError(
            f"{name}: {bits}-bit quantization is not supported (affine {', '.join(map(str, BITS))} bits)"
        )
    if weight.dtype != "U32" or weight.array.ndim != 2:
        raise ConvertError(
            f"{name}.weight: expected packed uint32 (rows, words), got {weight.dtype} {list(weight.shape)}"
        )
    rows, words = weight.shape
    columns = words * 32 // bits
    groups = scales.shape[-1] if scales.array.ndim == 2 else -1
    if scales.shape != biases.shape or groups * group_size != columns or scales.shape[0] != rows:
        raise ConvertError(
            f"{name}: shape mismatch for {bits}-bit, group size {group_size}: weight {list(weight.shape)}, "
            f"scales {list(scales.shape)}, biases {list(biases.shape)}"
        )
    q = unpack(weight.array, bits, columns).astype(np.float32).reshape(rows, groups, group_size)
    s, b = to_float32(scales)[:, :, None], to_float32(biases)[:, :, None]
    if scales.dtype == "F32":
        return Tensor("F32", (s * q + b).reshape(rows, columns))
    # half types: as mlx computes it, the product rounded to the type, then the sum rounded
    product = to_float32(from_float32(s * q, scales.dtype))
    return from_float32((product + b).reshape(rows, columns), scales.dtype)


def quantize(name: str, weight: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(packed weight, scales, biases) exactly as mlx-lm would write them (mx.quantize, affine)."""
    try:
        import mlx.core as mx
    except ImportError:
        raise ConvertError("quantizing (-q) uses mlx; install it (pip install mlx) or convert without -q") from None
    if bits not in BITS:
        raise ConvertError(f"--q-bits {bits} is not supported (affine {', '.join(map(str, BITS))} bits)")
    dt = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[weight.dtype]
    w = mx.array(to_float32(weight)).astype(dt)
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits, mode="affine")
    mx.eval(wq, s, b)

    def back(x):
        if x.dtype == mx.bfloat16:
            return Tensor("BF16", np.array(x.view(mx.uint16)))
        return Tensor({mx.float32: "F32", mx.float16: "F16", mx.uint32: "U32"}[x.dtype], np.array(x))

    return back(wq), back(s), back(b)
