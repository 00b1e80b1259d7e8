"""Attention masks: the MARS training rule (docs/method.md §3) and the decoding masks (docs/method.md §5-6).

Masks are boolean arrays, True where a query may attend a key. Backends turn them
into whatever their attention wants (additive float masks, usually).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def stream_positions(length: int, start: int = 0) -> np.ndarray:
    """Logical positions of the joined `noisy ++ clean` sequence: start..L-1, then 0..L-1."""
    return np.concatenate([np.arange(start, length, dtype=np.int64), np.arange(length, dtype=np.int64)])


def noisy_start(labels, block_size: int, ignore: int = -100) -> int:
    """Where the noisy stream may begin for a padded batch of labels (b, L): the start of the
    block holding the position before the batch's first usable label (position 0 never is one).

    A noisy query attends only its own block and clean keys, and only queries that predict a
    label carry loss; so blocks before this one (prompt only, in every row) are attended by no
    query that counts. Leaving them out changes no loss and saves their compute: in chat data
    with a system prompt they are a large part of the noisy stream.
    """
    usable = np.asarray(labels) != ignore
    usable[:, 0] = False
    has = usable.any(axis=1)
    if not has.any():
        return 0
    first = usable.argmax(axis=1)[has]
    return int(((first - 1) // block_size).min() * block_size)


def training_mask(lengths, length: int, block_size: int, start: int = 0) -> np.ndarray:
    """The docs/method.md §3 rule for a padded batch: shape (batch, 2L - start, 2L - start).

    `lengths[r]` is row r's own length (block-padded, <= L); the noisy stream holds positions
    [start, L) (`start` a multiple of B; 0 is the whole stream) and the clean stream follows
    with [0, L), in every row.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if length % block_size:
        raise ValueError(f"padded length {length} is not a multiple of block size {block_size}")
    if lengths.size and (lengths.max() > length or lengths.min() < 1):
        raise ValueError(f"row lengths must lie in [1, {length}], got {lengths.tolist()}")
    if start % block_size or not 0 <= start < length:
        raise ValueError(f"noisy start {start} is not a block start below {length}")
    p = stream_positions(length, start)
    clean = np.arange(p.size) >= length - start
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
    diag = np.arange(p.size)
    mask[:, diag, diag] |= ~real
    return mask


def training_inputs(ids, labels, lengths, block_size: int, mask_id: int, ignore: int = -100, start: int = 0):
    """Model inputs for a MARS batch: (input_ids (b, S), positions (b, S), mask (b, S, S)) with
    S = 2L - start (`start`: see `noisy_start`; 0 keeps the whole noisy stream).

    The noisy stream replaces every labelled position by MASK; the clean stream is the real ids.
    """
    ids = np.asarray(ids, dtype=np.int64)
    labels = np.asarray(labels, dtype=np.int64)
    batch, length = ids.shape
    noisy = np.where(labels != ignore, mask_id, ids)[:, start:]
    input_ids = np.concatenate([noisy, ids], axis=1)
    positions = np.broadcast_to(stream_positions(length, start), input_ids.shape).copy()
    return input_ids, positions, training_mask(lengths, length, block_size, start)


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


@dataclass(frozen=True)
class StepMask:
    """A decoding step's attention mask (b, width, cached + width), as few numbers as a device needs
    to build it (the torch backend's own forward builds it there; `dense` builds it on the host).

    Query j of row r (fed column j, key cached + j) may see key k when the query and the key are
    real (`keys`: (b, cached + width) bool, None where every key is), k <= cached + j, and a fed key
    (column c = k - cached) lies in the query's view: c <= see[r, j] or c >= start[r, j] (`see`,
    `start`: (b, width) int64 arrays or lists of rows, None where every query sees every column before it, plain causal;
    start[r, j] <= j: a query sees itself). A hole query sees itself alone. A group's columns
    (mars.core.decode.layout.with_groups) see the chain up to their anchor and their own block; the
    chain's columns see every column before them. The torch and MLX backends build it on the device
    (models.Transformer.attention_masks, mlx forward.step_mask), bit for bit as `dense` does."""

    cached: int
    width: int
    keys: np.ndarray | None = None
    see: np.ndarray | None = None
    start: np.ndarray | None = None

    def dense(self, batch: int = 1) -> np.ndarray:
        """The bool mask (b, width, cached + width); `batch` where neither `keys` nor `see` says it."""
        c, q = self.cached, self.width
        col = np.arange(c + q) - c
        j = np.arange(q)
        mask = np.broadcast_to(col[None, :] <= j[:, None], (batch, q, c + q))
        if self.see is not None:
            see, start = np.asarray(self.see, dtype=np.int64), np.asarray(self.start, dtype=np.int64)
            mask = mask & ((col[None, None, :] <= see[:, :, None]) | (col[None, None, :] >= start[:, :, None]))
        if self.keys is not None:
            keys = np.asarray(self.keys, dtype=bool)
            mask = (mask & keys[:, None, :] & keys[:, c:, None]) | (col[None, None, :] == j[None, :, None])
        return np.array(mask, dtype=bool)

    def padded(self, width: int, batch: int) -> StepMask:
        """The same mask for a feed widened to `width` columns by holes at the end of every row: the
        real queries see what they saw; a hole sees itself alone and nobody sees a hole."""
        pad = width - self.width
        if pad <= 0:
            return self
        keys = np.ones((batch, self.cached + self.width), dtype=bool) if self.keys is None else self.keys
        keys = np.concatenate([keys, np.zeros((batch, pad), dtype=bool)], axis=1)
        see, start = self.see, self.start
        if see is not None:
            see, start = np.asarray(see, dtype=np.int64), np.asarray(start, dtype=np.int64)
            own = np.broadcast_to(np.arange(self.width, width), (len(see), pad))
            see, start = np.concatenate([see, own], axis=1), np.concatenate([start, own], axis=1)
        return StepMask(self.cached, width, keys, see, start)


def dense_mask(mask, batch: int = 1) -> np.ndarray | None:
    """A step's mask as a bool array (b, q, kv) or None: a StepMask built on the host, an array as it is."""
    return mask.dense(batch) if isinstance(mask, StepMask) else mask


# The widths a padding decoder feeds (the torch backend's TorchDecoder(buckets=True), the MLX
# backend's compiled steps): a step's width rounded up to the next of these (past the last, to a
# multiple of it), so that a compiled or captured step meets a few shapes only. The padding is
# holes at the end of each row: never attended, never read.
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(width: int) -> int:
    """The width a step of `width` tokens is padded to (WIDTH_BUCKETS)."""
    for b in WIDTH_BUCKETS:
        if width <= b:
            return b
    last = WIDTH_BUCKETS[-1]
    return -(-width // last) * last


def pad_width(input_ids, positions, mask, valid, cached: int, width: int):
    """A step's host inputs padded from q to `width` columns with holes at the end of every row:
    ids 0, the row's last position, invalid, attending to themselves alone (as decode_mask makes a
    hole attend) and attended by nobody; the real positions' mask is unchanged."""
    b, q = input_ids.shape
    if width == q:
        return input_ids, positions, mask, valid
    pad = width - q
    ids = np.concatenate([input_ids, np.zeros((b, pad), dtype=input_ids.dtype)], axis=1)
    pos = np.concatenate([positions, np.repeat(positions[:, -1:], pad, axis=1)], axis=1)
    real = np.ones((b, q), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    valid = np.concatenate([real, np.zeros((b, pad), dtype=bool)], axis=1)
    if isinstance(mask, StepMask):
        return ids, pos, mask.padded(width, b), valid
    if mask is None:
        mask = decode_mask(np.ones((b, cached + q), dtype=bool), q)
    full = np.zeros((b, width, cached + width), dtype=bool)
    full[:, :q, : cached + q] = mask
    full[:, np.arange(q, width), cached + np.arange(q, width)] = True
    return ids, pos, full, valid
