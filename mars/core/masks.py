"""Attention masks: the MARS training rule (METHOD §3) and the decoding masks (METHOD §5-6).

Masks are boolean arrays, True where a query may attend a key. Backends turn them
into whatever their attention wants (additive float masks, usually).
"""

from __future__ import annotations

import numpy as np


def stream_positions(length: int) -> np.ndarray:
    """Logical positions of the joined `noisy ++ clean` sequence: 0..L-1 twice."""
    p = np.arange(length, dtype=np.int64)
    return np.concatenate([p, p])


def training_mask(lengths, length: int, block_size: int) -> np.ndarray:
    """The METHOD §3 rule for a padded batch: shape (batch, 2L, 2L).

    `lengths[r]` is row r's own length (block-padded, <= L); the noisy stream is
    [0, L) and the clean stream [L, 2L) in every row.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if length % block_size:
        raise ValueError(f"padded length {length} is not a multiple of block size {block_size}")
    if lengths.size and (lengths.max() > length or lengths.min() < 1):
        raise ValueError(f"row lengths must lie in [1, {length}], got {lengths.tolist()}")
    p = stream_positions(length)
    clean = np.arange(2 * length) >= length
    blk = p // block_size
    pq, pk = p[:, None], p[None, :]
    cq, ck = clean[:, None], clean[None, :]
    bq, bk = blk[:, None], blk[None, :]
    rule = (
        (cq & ck & (pk <= pq))  # clean -> clean: causal
        | (~cq & ~ck & (bk == bq) & (pk <= pq))  # noisy -> noisy: causal inside the block
        | (~cq & ck & (bk < bq))  # noisy -> clean: earlier blocks only
    )
    real = p[None, :] < lengths[:, None]  # (batch, 2L)
    mask = rule[None] & real[:, :, None] & real[:, None, :]
    # A padding query attends only to itself, so every softmax row has one allowed key.
    diag = np.arange(2 * length)
    mask[:, diag, diag] |= ~real
    return mask


def training_inputs(ids, labels, lengths, block_size: int, mask_id: int, ignore: int = -100):
    """Model inputs for a MARS batch: (input_ids (b, 2L), positions (b, 2L), mask (b, 2L, 2L)).

    The noisy stream replaces every labelled position by MASK; the clean stream is the real ids.
    """
    ids = np.asarray(ids, dtype=np.int64)
    labels = np.asarray(labels, dtype=np.int64)
    batch, length = ids.shape
    noisy = np.where(labels != ignore, mask_id, ids)
    input_ids = np.concatenate([noisy, ids], axis=1)
    positions = np.broadcast_to(stream_positions(length), (batch, 2 * length)).copy()
    return input_ids, positions, training_mask(lengths, length, block_size)


def decode_mask(key_valid: np.ndarray, query_len: int) -> np.ndarray:
    """Causal mask for `query_len` new tokens on top of a cache, with holes.

    `key_valid` (batch, kv) says which keys are real (cache entries and the new
    tokens, which are the last `query_len`). Holes (left padding, rows that wait)
    are attended by nobody; a hole query attends only to itself.
    Returns (batch, query_len, kv).
    """
    batch, kv = key_valid.shape
    q_index = kv - query_len + np.arange(query_len)
    causal = np.arange(kv)[None, :] <= q_index[:, None]
    query_valid = key_valid[:, q_index]
    mask = causal[None] & key_valid[:, None, :] & query_valid[:, :, None]
    mask[:, np.arange(query_len), q_index] = True
    return mask
