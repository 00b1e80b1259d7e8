"""N-gram (prompt lookup) drafts for lossless decoding.

Replies often repeat their prompt or themselves: names, code, lists. Lookup finds the
most recent earlier place where the sequence's last n tokens (prompt and output alike)
occurred and proposes the tokens that followed it there. The drafts are verified by the
same forward and the same rule as the masks' drafts, so the output is unchanged; they
cost no training and no mask columns.
"""

from __future__ import annotations

import numpy as np


def lookup(seq: list[int], *, max_drafts: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `max_drafts` tokens that followed the latest earlier occurrence of the last n
    tokens of `seq`, trying the longest n first (`max_ngram` down to `min_ngram`); [] if
    none occurs."""
    if max_drafts <= 0 or len(seq) < 2:
        return []
    arr = np.asarray(seq, dtype=np.int64)
    end = len(arr)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        tail = arr[end - n :]
        # Windows starting at i = 0 .. end - n - 1 (the tail itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(arr[: end - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in arr[start : start + max_drafts]]
    return []
