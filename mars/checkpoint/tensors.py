"""Tensor I/O without a framework: safetensors read and written with numpy, bfloat16 kept bit-exact.

A tensor is a `Tensor(dtype, array)`: `dtype` is the safetensors name ("F32", "BF16", ...) and
`array` holds the raw storage (bfloat16 as uint16 bit patterns), so reading then writing a file
reproduces every tensor byte for byte. Arithmetic goes through `to_float32` / `from_float32`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class ConvertError(ValueError):
    """Input `mars convert` cannot handle; the one-line message names the file or tensor and the fix."""


# safetensors dtype name -> numpy storage dtype (bfloat16 is stored as its uint16 bit pattern)
_STORAGE = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
FLOATS = ("F64", "F32", "F16", "BF16")
# --dtype names <-> safetensors names
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass
class Tensor:
    dtype: str  # safetensors dtype name
    array: np.ndarray  # storage: uint16 for BF16

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOATS

    def transpose(self) -> "Tensor":
        return Tensor(self.dtype, np.ascontiguousarray(self.array.T))


def to_float32(t: Tensor) -> np.ndarray:
    if t.dtype == "BF16":
        return (t.array.astype(np.uint32) << 16).view(np.float32)
    if t.dtype not in FLOATS:
        raise ConvertError(f"tensor of type {t.dtype} is not a float tensor")
    return t.array.astype(np.float32)


def from_float32(x: np.ndarray, dtype: str) -> Tensor:
    """Round float32 values to `dtype` (round to nearest even, as torch and mlx do for bfloat16)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "BF16":
        bits = x.view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        if nan.any():
            rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # keep NaN a NaN
        return Tensor("BF16", rounded)
    return Tensor(dtype, x.astype(_STORAGE[dtype]))


def cast(t: Tensor, dtype: str) -> Tensor:
    """A float tensor in another float type; non-float tensors and same-type casts unchanged."""
    if not t.is_float or t.dtype == dtype:
        return t
    if dtype != "BF16" and t.dtype != "BF16":
        return Tensor(dtype, t.array.astype(_STORAGE[dtype]))
    return from_float32(to_float32(t), dtype)


def read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict]:
    """(tensors, metadata) of one .safetensors file."""
    path = Path(path)
    data = path.read_bytes()
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
    except (struct.error, ValueError):
        raise ConvertError(f"{path}: not a safetensors file (bad header)") from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out = {}
    for name, info in header.items():
        dtype = info["dtype"]
        if dtype not in _STORAGE:
            raise ConvertError(f"{path}: tensor {name} has type {dtype}, which mars convert does not handle")
        start, end = info["data_offsets"]
        arr = np.frombuffer(
            data, dtype=_STORAGE[dtype], count=(end - start) // np.dtype(_STORAGE[dtype]).itemsize, offset=base + start
        )
        out[name] = Tensor(dtype, arr.reshape(info["shape"]))
    return out, meta


def write_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict | None = None) -> None:
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name]
        blob = np.ascontiguousarray(t.array).astype(t.array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    if metadata:
        header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


SHARD_BYTES = 5 * 1024**3


def write_weights(directory: Path, tensors: dict[str, Tensor], fmt: str) -> None:
    """model.safetensors, or shards of at most 5 GB plus model.safetensors.index.json."""
    metadata = {"format": "pt" if fmt == "hf" else "mlx"}
    shards, size = [{}], 0
    for name in sorted(tensors):
        n = tensors[name].array.nbytes
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    if len(shards) == 1:
        write_safetensors(directory / "model.safetensors", shards[0], metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / fname, shard, metadata)
        weight_map.update({k: fname for k in shard})
    index = {
        "metadata": {"total_size": sum(t.array.nbytes for t in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_weights(directory: Path, exclude: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """All tensors of the *.safetensors files in a model directory (files named in `exclude` skipped)."""
    directory = Path(directory)
    files = sorted(p for p in directory.glob("*.safetensors") if p.name not in exclude)
    if not files:
        if any(directory.glob("*.bin")):
            raise ConvertError(
                f"{directory}: only PyTorch .bin weights; re-save the model as safetensors "
                f"(save_pretrained(safe_serialization=True))"
            )
        raise ConvertError(f"{directory}: no *.safetensors weights")
    out: dict[str, Tensor] = {}
    for f in files:
        tensors, _ = read_safetensors(f)
        for k in tensors:
            if k in out:
                raise ConvertError(f"{f}: tensor {k} appears in more than one weights file")
        out.update(tensors)
    return out
