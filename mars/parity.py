"""Parity with AR in the number format a run decoded in: how many replies equal AR's, and
where and how closely each other reply left it.

Lossless mode promises exactly AR's output, and holds it bit for bit in float32. In a
narrower format (bfloat16, float16, an MLX model with quantized weights) a forward of
several tokens can round differently from a forward of one, so a lossless reply may part
from AR's in the same format: at a position where AR's two best logits are closer than the
format's rounding, the other forward's rounding picks the other token, and the replies go
their own ways from there. Every engine that verifies drafts has this limit; this module
measures it for the user.

For each reply that differs, its first divergence (the prompt, the position in the reply,
AR's token and the other token there) and AR's top-2 logit gap at that position: the
largest minus the second-largest logit of a plain forward of the prompt and AR's reply up
to that position (one forward per differing reply, batch 1, no cache, no drafts). A gap of
a few units in the last place (ulp) of the format at the logits' magnitude (bfloat16 keeps
8 significant bits: 0.0625 at a logit of 10 to 16) is a near-tie that rounding decides, not
an error of the method; a gap far above it is worth a report. The plain forward is one more
rounding of AR's computation, so at a near-tie its gap, like AR's own choice, is known only
to about that rounding.

Backend-neutral: it reaches the model through its decoder's `logits(cache, ids, positions,
mask, read)` (both backends' decoders have it) and reads the logits with `tolist()`, which
torch tensors on any device and MLX arrays of any dtype (numpy has no bfloat16) support.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

# Significant bits after the leading one, per float format: a logit v is kept to a step of
# 2 ** (floor(log2 |v|) - bits), its ulp.
MANTISSA_BITS = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}

# What the parity fields mean, for the JSON's readers, the tables' legends and --help.
GAP_MEANING = (
    "ar_gap: AR's largest minus second-largest logit at the first divergence, from a plain forward of "
    "the prompt and AR's reply up to it; below a few ulps of the format (the step between neighbouring "
    "logits at that magnitude) it is a near-tie that rounding decides, not an error of the method"
)


def common_prefix(a, b) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def first_divergence(ar, other) -> int | None:
    """The index of the first reply token where `other` differs from `ar`; where one reply is
    a prefix of the other (it stopped earlier), the shorter length; None for equal replies."""
    n = common_prefix(ar, other)
    return None if n == len(ar) == len(other) else n


def _dtype_name(dtype) -> str:
    # "torch.bfloat16", "mlx.core.bfloat16" -> "bfloat16"
    return str(dtype).rsplit(".", 1)[-1]


def number_format(loaded) -> tuple[str, str | None]:
    """(the format a loaded model computes in, as a report names it: "torch bfloat16",
    "mlx float32", "mlx 4-bit (float16)"; the float dtype its logits are rounded to).
    A torch model states its dtype; an MLX model's is read off its modules: quantized layers
    carry `bits` and keep float scales, the others float weights (the most common wins)."""
    dtype = getattr(loaded, "dtype", None)
    if dtype is not None:
        name = _dtype_name(dtype)
        return f"{loaded.backend} {name}", name
    bits, floats = set(), Counter()
    for _, module in loaded.model.named_modules():
        quantized = isinstance(getattr(module, "bits", None), int)
        if quantized:
            bits.add(module.bits)
        array = getattr(module, "scales" if quantized else "weight", None)
        if array is not None and _dtype_name(getattr(array, "dtype", "")) in MANTISSA_BITS:
            floats[_dtype_name(array.dtype)] += 1
    name = floats.most_common(1)[0][0] if floats else None
    if not bits:
        return f"{loaded.backend} {name or 'unknown dtype'}", name
    width = "/".join(str(b) for b in sorted(bits))
    return f"{loaded.backend} {width}-bit" + (f" ({name})" if name else ""), name


def ulp(value: float, dtype: str | None) -> float | None:
    """The step between neighbouring numbers of `dtype` at `value`'s magnitude (None for an unknown dtype)."""
    bits = MANTISSA_BITS.get(dtype or "")
    if bits is None:
        return None
    exponent = math.frexp(abs(value))[1] - 1 if value else -126  # frexp: value = m * 2**e, 0.5 <= |m| < 1
    return 2.0 ** (exponent - bits)


def ar_logits(decoder, ids) -> np.ndarray:
    """The logits (float64, host) that predict the token after `ids`: one plain forward of
    `ids` through the decoder, batch 1, no cache, plain causal attention."""
    n = len(ids)
    out = decoder.logits(
        None,
        np.asarray([ids], dtype=np.int64),
        np.arange(n, dtype=np.int64)[None],
        None,
        np.asarray([[n - 1]], dtype=np.int64),
    )
    return np.asarray(out.tolist(), dtype=np.float64).reshape(-1)


def top2_gap(logits: np.ndarray) -> tuple[float, float]:
    """(largest minus second-largest logit, the largest logit)."""
    top = np.partition(logits, -2)[-2:]
    return float(top[1] - top[0]), float(top[1])


def parity(decoder, loaded, prompts, ar_replies, replies) -> dict:
    """How `replies` compare with `ar_replies` (same prompts, same run, same format): the
    number identical and, per differing reply, its first divergence with AR's top-2 logit gap
    there (GAP_MEANING). `decoder`: the StepBackend that decoded them (its `logits` runs the
    forwards); `loaded`: the loaded model (its format)."""
    if not (len(prompts) == len(ar_replies) == len(replies)):
        raise ValueError(
            f"parity: {len(prompts)} prompts, {len(ar_replies)} AR replies and {len(replies)} replies; "
            "pass one reply of each per prompt"
        )
    fmt, dtype = number_format(loaded)
    divergences = []
    for i, (prompt, ar, other) in enumerate(zip(prompts, ar_replies, replies)):
        at = first_divergence(ar, other)
        if at is None:
            continue
        logits = ar_logits(decoder, list(prompt) + list(ar[:at]))
        gap, top = top2_gap(logits)
        token = int(other[at]) if at < len(other) else None
        step = ulp(top, dtype)
        divergences.append(
            {
                "prompt": i,
                "position": at,
                "ar_token": int(ar[at]) if at < len(ar) else None,  # None: that reply stopped here
                "token": token,
                "ar_gap": gap,
                # AR's largest logit minus its logit for the other token (= ar_gap when that token is AR's runner-up).
                "token_gap": float(top - logits[token]) if token is not None and token < logits.size else None,
                "ulp": step,  # the format's step at AR's largest logit
                "ar_gap_ulps": gap / step if step else None,
            }
        )
    largest = max(divergences, key=lambda d: d["ar_gap"], default=None)
    return {
        "identical": len(replies) - len(divergences),
        "replies": len(replies),
        "format": fmt,
        "logits_dtype": dtype,
        "max_ar_gap": largest["ar_gap"] if largest else None,
        "max_ar_gap_ulps": largest["ar_gap_ulps"] if largest else None,
        "divergences": divergences,
    }


def summary(p: dict) -> str:
    """One line for a table: identical n/N, the format, and the largest AR top-2 gap among divergences."""
    line = f"{p['identical']}/{p['replies']} identical to AR ({p['format']})"
    if p["divergences"]:
        ulps = f" = {p['max_ar_gap_ulps']:.3g} ulp" if p.get("max_ar_gap_ulps") is not None else ""
        line += f"; {len(p['divergences'])} differ, largest AR top-2 logit gap there {p['max_ar_gap']:.4g}{ulps}"
    return line
