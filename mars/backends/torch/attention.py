"""Attention for the torch decoder on the CPU: grouped-query attention without copying the keys,
and, in bfloat16 and float16, attention whose query rows each compute what a one-token forward
computes.

transformers' `sdpa` attention lets torch's kernel share each key/value head among its
query heads (`enable_gqa`) only when no attention mask is given; with a mask (any
multi-token forward on a cache, any batch with holes) it first copies every cached key
and value once per query head of the group. On the CPU the kernel handles a mask with
`enable_gqa` as well, with bit-identical results, so the copy (which grows with the
cache) is pure overhead: `mars_sdpa` skips it there and is transformers' `sdpa`
everywhere else.

Row-exact attention (`row_exact_attention`, asked by the decoder for its bfloat16 and float16
forwards: mars's own forward passes its rows as an argument; transformers' modules carry the
keyword `ROW_EXACT` from the body's call down to `grouped_sdpa`, as they carry any keyword).
Lossless decoding compares the argmax of a multi-token forward with the drafts, so a row of that
forward must compute what a one-token forward at its place computes. In float32 torch's kernel
gives a row other last bits than a one-token forward gives, which almost never moves an argmax.
In bfloat16 a difference in the last bits often rounds to a whole unit of a hidden state, which
every later layer carries on: with the default model, 11 of 32 lossless replies equalled AR's.
Measured on a 2-core AVX2 CPU (torch 2.13), the kernel gives a query row other bits

- with more query rows in the call (its matrix products take other paths by the number of
  rows: a row alone and the same row among 4 or more differ), and
- with another number of keys or other key columns, masked ones included: its softmax adds the
  keys up in vector-wide lanes, by column, and the last partial vector apart with another `exp`.

So here every query row is a problem of its own, posed the same way whatever the forward around
it: its group of query heads against their key/value head (a product of as many rows as the
group has heads, whatever the forward's width), in float32 (the keys and values upcast exactly,
the output rounded to the model's dtype once; this also spares the kernel's slow bfloat16
products on a CPU without bfloat16 instructions), against its keys
gathered into consecutive columns from column 0 (a batch row's left padding and holes left out)
and padded with masked zeros to a multiple of `KEY_BLOCK` keys, so no partial vector remains.
Rows whose keys are the first keys of one gathered sequence share it; rows that pad to the same
number of keys share a kernel call (torch computes each problem of a batch alone). Rows fed a
mask token (their outputs only propose drafts) and holes need not be exact: they attend within
the keys as they lie, masked, and cost no gather of their own. Float32 forwards are not touched.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

NAME = "mars_sdpa"
# Row-exact attention pads the keys to a multiple of this many: 64 float32 is a whole number of
# vectors on every CPU torch vectorizes for (8 on AVX2, 16 on AVX-512, 4 on NEON), and it
# divides the kernel's blocks of keys (512).
KEY_BLOCK = 64
REDUCED = (torch.bfloat16, torch.float16)

# The keyword a transformers body's call takes row-exact attention by: (the rows of the forward that
# must compute a one-token forward's bits, (batch, q) bool or None for all; a dict the forward's
# layers share their plans in, by mask).
ROW_EXACT = "mars_row_exact"


def _plain(kwargs) -> bool:
    return (
        kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and not kwargs.get("output_attentions")
    )


def grouped_sdpa(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    exact = kwargs.pop(ROW_EXACT, None)
    plain = _plain(kwargs)
    reduced = query.dtype in REDUCED and query.device.type == "cpu" and not query.requires_grad
    if exact is not None and plain and reduced:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = row_exact_attention(query, key, value, attention_mask, scaling, causal, *exact)
        if out is not None:
            return out, None
    if groups > 1 and attention_mask is not None and query.device.type == "cpu" and plain:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=False,
            enable_gqa=True,
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def _allowed(attention_mask, batch: int, q: int, n: int, causal: bool) -> np.ndarray | None:
    """(batch, q, n) bool: which keys each query row attends to; None for a mask that is more
    than a mask (a bias, or one per head)."""
    if attention_mask is None:  # every key; causal over the new rows when asked (a prompt, no cache)
        last = np.arange(q)[:, None] + (n - q) if causal else np.full((q, 1), n - 1)
        return np.broadcast_to(np.arange(n)[None, :] <= last, (batch, q, n))
    mask = attention_mask[..., :n]
    if mask.dim() != 4 or mask.shape[1] != 1:
        return None
    if mask.dtype != torch.bool:
        allowed = mask == 0
        if not (allowed | (mask <= torch.finfo(mask.dtype).min / 2)).all():
            return None
        mask = allowed
    return np.broadcast_to(mask[:, 0].cpu().numpy(), (batch, q, n))


def _padded(count: int) -> int:
    return max(1, -(-count // KEY_BLOCK)) * KEY_BLOCK


def _source(columns, entries):
    """One key sequence of a batch row and its kernel calls: (columns gathered, None for the keys
    as they lie; keys to hold; [(padded keys, query rows or None for all, additive mask (rows,
    1, 1, padded keys))]). `entries`: (padded keys, query row, bool mask row) each."""
    calls = []
    for length in sorted({e[0] for e in entries}):
        part = sorted((e for e in entries if e[0] == length), key=lambda e: e[1])
        rows = torch.tensor([e[1] for e in part])
        additive = torch.full((len(part), length), float("-inf"))
        additive.masked_fill_(torch.from_numpy(np.stack([e[2] for e in part])), 0.0)
        calls.append((length, rows, additive[:, None, None]))
    return columns, max(e[0] for e in entries), calls


def _plan(attention_mask, batch: int, q: int, n: int, causal: bool, exact_rows=None, plans=None):
    """Per batch row, its key sequences (`_source`); None where the plain kernel must run. `plans`:
    a dict the forward's layers share plans in (None: planned for this call alone)."""
    shape = (batch, q, n, causal)
    kept = plans.get(id(attention_mask)) if plans is not None else None
    if kept is not None and kept[0] is attention_mask and kept[1] == shape:
        return kept[2]
    allowed = _allowed(attention_mask, batch, q, n, causal)
    if allowed is None:
        return None
    exact_rows = exact_rows if exact_rows is not None and exact_rows.shape == (batch, q) else None
    plan = []
    for b in range(batch):
        sets = allowed[b]
        # Sequences of gathered key columns, longest first: a row whose keys are the first keys
        # of one computes on it; an exact row whose keys are no sequence's first starts its own.
        sequences, loose = [], []
        for j in np.argsort(-sets.sum(1), kind="stable"):
            cols = np.flatnonzero(sets[j])
            home = [s for s in sequences if len(cols) <= len(s[0]) and np.array_equal(s[0][: len(cols)], cols)]
            if home:
                home[0][1].append(j)
            elif exact_rows is None or exact_rows[b, j]:
                sequences.append((cols, [j]))
            else:
                loose.append(j)
        sources, as_they_lie = [], []
        for cols, rows in sequences:
            entries = []
            for j in rows:
                count = int(sets[j].sum())
                entries.append((_padded(count), int(j), np.arange(_padded(count)) < count))
            if cols.size == 0 or cols[-1] == cols.size - 1:  # columns 0, 1, ...: the keys as they lie
                as_they_lie += entries
            else:
                sources.append(_source(torch.from_numpy(cols), entries))
        for j in loose:  # attends within the keys as they lie, masked
            length = _padded(int(np.flatnonzero(sets[j])[-1]) + 1 if sets[j].any() else 0)
            row = np.zeros(length, dtype=bool)
            row[: min(length, n)] = sets[j, :length]
            as_they_lie.append((length, int(j), row))
        if as_they_lie:
            sources.insert(0, _source(None, as_they_lie))
        # A call of every row in order writes the batch row's output whole.
        plan.append(
            [
                (cols, length, [(L, None if len(rows) == q else rows, m) for L, rows, m in calls])
                for cols, length, calls in sources
            ]
        )
    if plans is not None:  # kept for the forward's other layers
        plans[id(attention_mask)] = (attention_mask, shape, plan)
    return plan


def _upcast(x: torch.Tensor, length: int) -> torch.Tensor:
    """`x` (1, heads, keys, dim) in float32 with `length` keys: zeros past its own (a masked key
    must be finite: its weight is an exact 0, and 0 times a finite value adds nothing)."""
    out = x.new_empty((*x.shape[:2], length, x.shape[-1]), dtype=torch.float32)
    keep = min(length, x.shape[2])
    out[:, :, :keep].copy_(x[:, :, :keep])
    out[:, :, keep:].zero_()
    return out


def row_exact_attention(query, key, value, attention_mask, scaling, causal: bool = True, exact_rows=None, plans=None):
    """Attention output (batch, q, heads, dim) in the query's dtype, each query row computed as its
    own problem (see the module's docstring); None where the mask is more than a mask. Without a
    mask the rows attend causally (`causal`, the last row to the last key) or to every key.
    `exact_rows` (batch, q) bool, the rows that must be exact (None: every row); `plans`: as `_plan`."""
    batch, heads, q, dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    if heads % kv_heads:
        return None
    plan = _plan(attention_mask, batch, q, n, bool(causal) and attention_mask is None, exact_rows, plans)
    if plan is None:
        return None
    # (batch, q, kv heads, heads per kv head, dim): query head h reads key/value head h // group.
    rows = query.transpose(1, 2).reshape(batch, q, kv_heads, heads // kv_heads, dim).float()
    out = rows.new_empty(rows.shape[:-1] + (value.shape[-1],))
    for b, sources in enumerate(plan):
        for columns, length, calls in sources:
            k, v = key[b : b + 1], value[b : b + 1]
            if columns is not None:
                columns = columns.to(key.device)
                k, v = k.index_select(2, columns), v.index_select(2, columns)
            k, v = _upcast(k, length), _upcast(v, length)
            for keys, picked, mask in calls:
                qs = rows[b] if picked is None else rows[b, picked]
                m = qs.shape[0]
                # Each of the m problems reads the same keys (a stride-0 batch: no copy).
                ks, vs = k[:, :, :keys].expand(m, -1, -1, -1), v[:, :, :keys].expand(m, -1, -1, -1)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.to(query.device), scale=scaling)
                if picked is None:
                    out[b] = o
                else:
                    out[b, picked] = o
    return out.reshape(batch, q, heads, -1).to(query.dtype)


def use_grouped_sdpa(model: torch.nn.Module) -> bool:
    """Switch a transformers model that runs `sdpa` to `mars_sdpa` (same masks, same results);
    returns whether it was switched."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError):
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME
