"""N-gram (prompt lookup) drafts: replies often repeat their prompt or themselves, so lookup finds
the latest earlier place where the sequence's last n tokens occurred, for the longest n up to
`MAX_NGRAM`, and proposes what followed there. A longer match keeps many more of its drafts, so
drafts count under one draft source per match-length bucket (`source`), each with its own keep rates.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_NGRAM = 10
# Drafts from a match of n tokens count under the largest bucket <= n.
BUCKETS = (1, 2, 3, 6)


def match(seq: list[int], *, max_drafts: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1) -> tuple[int, list[int]]:
    """(n, drafts): up to `max_drafts` tokens that followed the latest earlier occurrence of
    the last n tokens of `seq`, for the longest n from `max_ngram` down to `min_ngram` that
    occurs; (0, []) if none does."""
    if max_drafts <= 0 or len(seq) < 2:
        return 0, []
    seq = [int(t) for t in seq]
    end = len(seq)
    starts = [i for i in range(end - 1) if seq[i] == seq[-1]]  # the earlier places of the last token
    return _longest(seq, end, starts, max_drafts, max_ngram, min_ngram)


def _longest(
    seq: list[int], end: int, starts: list[int], max_drafts: int, max_ngram: int, min_ngram: int = 1
) -> tuple[int, list[int]]:
    """`match` on the first `end` tokens of `seq` from `starts`, the earlier places of its last token:
    each longer n keeps those whose preceding tokens match too; the latest of the longest gives drafts.
    Over plain lists: a step's lookup compares a few places, where array operations cost more."""
    found = best = 0
    for n in range(1, min(max_ngram, end - 1) + 1):
        if n > 1:
            want = seq[end - n]
            starts = [i for i in starts if i >= n - 1 and seq[i - (n - 1)] == want]
        if not starts:
            break
        if n >= min_ngram:
            found, best = n, starts[-1]
    if not found:
        return 0, []
    return found, [int(t) for t in seq[best + 1 : min(best + 1 + max_drafts, end)]]


class _Index:
    """Where each token of one sequence occurs: what `match` finds by scanning the whole sequence,
    kept up to date as the sequence grows, and searched over the sequence's own list."""

    def __init__(self, seq: list[int]):
        self.seq = seq  # the row's own list (it only grows); held, so its id stays this index's
        self.n = 0  # tokens of `seq` indexed so far
        self.last = None  # the last of them, as indexed
        self.where: dict[int, list[int]] = {}

    def update(self) -> bool:
        """Index the tokens added since the last call; False where `seq` changed otherwise."""
        seq, n = self.seq, self.n
        if len(seq) < n or (n and seq[n - 1] != self.last):
            return False
        where = self.where
        for j in range(n, len(seq)):
            t = int(seq[j])
            where.setdefault(t, []).append(j)
        self.n = len(seq)
        if self.n:
            self.last = seq[self.n - 1]
        return True

    def match(self, max_drafts: int, max_ngram: int = MAX_NGRAM) -> tuple[int, list[int]]:
        """`match` on the indexed sequence, in work growing with its last token's earlier places."""
        end, seq = self.n, self.seq
        if max_drafts <= 0 or end < 2:
            return 0, []
        starts = self.where[int(seq[end - 1])][:-1]  # earlier places of the last token
        return _longest(seq, end, starts, max_drafts, max_ngram)


class NgramLookup:
    """The prompt-lookup draft source (mars.core.decode.drafts.Proposer). It indexes up to `KEEP`
    sequences it was asked about (the least recently asked dropped first), so a step's lookup does
    not rescan a row's whole prompt and reply."""

    name = "ngram"
    label = "n-gram drafts"
    KEEP = 256

    def __init__(self):
        self._index: OrderedDict[int, _Index] = OrderedDict()

    def propose(self, seq: list[int], max_drafts: int) -> tuple[str, list[int]] | None:
        index = self._index.get(id(seq))
        if index is None or index.seq is not seq or not index.update():
            index = _Index(seq)
            index.update()
            self._index[id(seq)] = index
            while len(self._index) > self.KEEP:
                self._index.popitem(last=False)
        self._index.move_to_end(id(seq))
        n, found = index.match(max_drafts)
        return (source(n), found) if found else None


def source(n: int) -> str:
    """The draft source a match of n tokens counts under: "ngram" plus its bucket."""
    return f"ngram{max(b for b in BUCKETS if b <= n)}"
