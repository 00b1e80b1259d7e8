"""Corpus drafts: what the model's own earlier replies say comes next. A greedy model repeats its
phrasing across prompts, so lookup finds the longest n (`MAX_NGRAM` down to `MIN_NGRAM`) whose last
n tokens of the sequence occur in a draft corpus (replies the model wrote, `mars corpus`) and
proposes the continuation most of those places agree on.

Kept beside a checkpoint as `draft_corpus.npz` (`FILE`): one int32 array `tokens`, the sequences
joined by -1. Every n-gram is hashed once (64-bit polynomial hashes, sorted per n), so a lookup is
a few binary searches and a vote.
"""

from __future__ import annotations

import bisect
import io
from collections import Counter
from pathlib import Path

import numpy as np

from ...files import atomic_write_bytes

FILE = "draft_corpus.npz"
FORMAT = 1
MAX_NGRAM = 8
MIN_NGRAM = 2
# At most this many matching places vote on a continuation (the latest in the corpus).
MAX_PLACES = 256
# Drafts from a match of n tokens count under the largest bucket <= n.
BUCKETS = (2, 3, 4, 6)
_PI = 0x9E3779B97F4A7C15  # the hash's multiplier (odd, 64-bit)
_P = np.uint64(_PI)
_MASK = (1 << 64) - 1


class CorpusError(ValueError):
    """A draft corpus file that cannot be used (names the file and what is wrong)."""


def _hashes(values: np.ndarray, n: int) -> np.ndarray:
    """h[e] = the hash of values[e - n + 1 : e + 1] for e >= n - 1 (uint64, wrapping)."""
    h = values.copy()
    for _ in range(1, n):
        h = h[:-1] * _P + values[len(values) - len(h) + 1 :]
    return h


class DraftCorpus:
    """A draft source (mars.core.decode.drafts.Proposer): token sequences (`sequences`, or one flat
    array with -1 between them) indexed for `match`. Immutable once built: copies share it."""

    name = "corpus"
    label = "corpus drafts"

    def __init__(self, sequences=None, *, tokens: np.ndarray | None = None):
        if tokens is None:
            parts = []
            for seq in sequences or ():
                parts += [np.asarray(seq, dtype=np.int64).reshape(-1), np.array([-1], dtype=np.int64)]
            tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size and (tokens < -1).any():
            raise CorpusError("a draft corpus holds token ids >= 0 and -1 between sequences")
        if not tokens.size or tokens[-1] != -1:
            tokens = np.concatenate([tokens, np.array([-1], dtype=np.int64)])
        self.tokens = tokens
        self._index: dict[int, tuple[np.ndarray, np.ndarray, set[int]]] | None = None
        self._views = None  # (per n the hashes' and places' memoryviews, the tokens'), made with the index

    def __len__(self) -> int:
        """Tokens in the corpus (separators not counted)."""
        return int((self.tokens >= 0).sum())

    def __deepcopy__(self, memo):
        return self

    def _build(self) -> dict[int, tuple[np.ndarray, np.ndarray, set[int]]]:
        """Per n: (sorted hashes of the n-grams without a separator, the position just after each,
        the hashes that two different n-grams share: almost always none)."""
        t = self.tokens
        values = (t + 1).astype(np.uint64)  # separators hash as 0
        # run[e]: how many tokens up to e (inclusive) since the last separator
        idx = np.arange(t.size)
        last_sep = np.maximum.accumulate(np.where(t < 0, idx, -1))
        run = idx - last_sep
        index = {}
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            if t.size < n:
                break
            h = _hashes(values, n)
            ends = np.arange(n - 1, t.size)
            ok = run[ends] >= n
            h, after = h[ok], ends[ok] + 1
            order = np.argsort(h, kind="stable")  # equal hashes keep corpus order
            h, after = h[order], after[order]
            # A hash shared by two different n-grams has two such neighbours in the sorted order.
            pairs = np.flatnonzero(h[1:] == h[:-1])
            window = np.arange(-n, 0)
            differ = (t[after[pairs, None] + window] != t[after[pairs + 1, None] + window]).any(axis=1)
            index[n] = (h, after, set(h[pairs[differ]].tolist()))
        return index

    def match(self, seq, *, max_drafts: int) -> tuple[int, list[int]]:
        """(n, drafts): for the longest n (MAX_NGRAM .. MIN_NGRAM) whose last n tokens of `seq`
        occur in the corpus, up to `max_drafts` tokens that follow there: at each draft the
        token most places agree on (the first by plurality, the next ones while a majority
        of the places still in the vote agree); (0, []) if no n matches."""
        if max_drafts <= 0 or len(seq) < MIN_NGRAM:
            return 0, []
        if self._index is None:
            self._index = self._build()
            # The index and the tokens as memoryviews: a lookup's binary searches and reads in plain
            # Python (bisect), without an array operation's cost per call.
            views = {n: (memoryview(h), memoryview(after)) for n, (h, after, _) in self._index.items()}
            self._views = views, memoryview(self.tokens)
        tail = [int(x) for x in seq[-MAX_NGRAM:]]
        # The hash of the last n tokens for every n at once, as _hashes computes it: a token's value
        # (id + 1) times P to the power of how many tokens follow it, wrapping at 64 bits.
        wants, h, power = [0], 0, 1
        for n in range(1, len(tail) + 1):
            h = (h + (tail[-n] + 1) * power) & _MASK
            power = (power * _PI) & _MASK
            wants.append(h)
        # The tail's last n tokens occur for every n up to the longest that does (a place of n tokens is
        # one of their last n - 1 too): a binary search over n, the shortest first (most lookups of a
        # reply find none, or the shortest alone).
        lo, hi = MIN_NGRAM, min(MAX_NGRAM, len(tail))
        best, places = 0, None
        while lo <= hi:
            n = lo if not best else (lo + hi + 1) // 2
            found = self._places(n, wants[n], tail)
            if found is None:
                if not best:
                    return 0, []
                hi = n - 1
            else:
                best, places, lo = n, found, n + 1
        return best, self._continue(places, max_drafts)

    def _places(self, n: int, want: int, tail: list[int]) -> list[int] | None:
        """The latest places (up to MAX_PLACES) where the tail's last n tokens occur, each the
        position just after them; None where they do not occur."""
        if n not in self._index:
            return None
        (hv, av), tv = self._views[0][n], self._views[1]
        lo = bisect.bisect_left(hv, want)
        if lo == len(hv) or hv[lo] != want:
            return None
        hi = bisect.bisect_right(hv, want, lo)
        ngram = tail[-n:]
        if want in self._index[n][2]:  # the places hold different n-grams: keep the tail's, then the latest
            places = [at for at in av[lo:hi].tolist() if tv[at - n : at].tolist() == ngram]
            return places[-MAX_PLACES:] or None
        # Every place holds one n-gram: the latest says whether it is the tail's (no collision).
        places = av[max(lo, hi - MAX_PLACES) : hi].tolist()
        return places if tv[places[-1] - n : places[-1]].tolist() == ngram else None

    def propose(self, seq, max_drafts: int) -> tuple[str, list[int]] | None:
        """Proposer: the drafts of `match` and the statistics key of their match length, or None."""
        n, found = self.match(seq, max_drafts=max_drafts)
        return (source(n), found) if found else None

    def _continue(self, places: list[int], max_drafts: int) -> list[int]:
        """The drafts `places` (where the tail ends in the corpus) vote for, a column at a time in
        plain Python: what follows each place still in the vote, read off the index's memoryview
        (reads past the corpus's end give its last separator). The first draft is the plurality (ties
        to the smallest id), each next one the majority of the places that agreed so far, if any; a
        separator ends them. A lookup's few hundred reads at most cost less so than array operations,
        whose code a forward on a CPU evicts between two steps."""
        tv = self._views[1]
        end = len(tv) - 1  # the corpus ends with a separator
        drafts: list[int] = []
        for j in range(max_drafts):
            nxt = [tv[at + j] if at + j <= end else -1 for at in places]
            token = nxt[0]
            agree = nxt.count(token)
            if agree != len(nxt):  # the places disagree here
                if j:  # past the first draft only a majority counts: if there is one, it is the median
                    token = sorted(nxt)[len(nxt) // 2]
                    agree = nxt.count(token)
                    if 2 * agree <= len(nxt):
                        break
                else:  # the first draft: the plurality, ties to the smallest id
                    votes = Counter(nxt)
                    token = min(votes, key=lambda v: (-votes[v], v))
                    agree = votes[token]
                places = [at for at, t in zip(places, nxt) if t == token]
            if token < 0:
                break
            drafts.append(token)
        return drafts

    def save(self, path: Path) -> None:
        """Write `path` (an .npz) atomically."""
        buffer = io.BytesIO()
        np.savez_compressed(buffer, tokens=self.tokens.astype(np.int32), format=np.int32(FORMAT))
        atomic_write_bytes(path, buffer.getvalue())

    @classmethod
    def load(cls, path: Path) -> DraftCorpus:
        path = Path(path)
        try:
            with np.load(path) as f:
                arrays = {name: f[name] for name in f.files}
        except (OSError, ValueError) as e:
            raise CorpusError(f"{path}: cannot read a draft corpus ({e}); build one with `mars corpus`") from None
        if "tokens" not in arrays:
            raise CorpusError(f"{path}: no 'tokens' array (not a draft corpus; build one with `mars corpus`)")
        tokens, fmt = arrays["tokens"], int(arrays.get("format", FORMAT))
        if fmt != FORMAT:
            raise CorpusError(
                f"{path}: draft corpus format {fmt}, this version reads {FORMAT}; rebuild it with `mars corpus`"
            )
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise CorpusError(f"{path}: 'tokens' must be a 1-D integer array")
        return cls(tokens=tokens)


def source(n: int) -> str:
    """The draft source a match of n tokens counts under: "corpus" plus its bucket."""
    return f"corpus{max(b for b in BUCKETS if b <= n)}"


def beside(checkpoint) -> DraftCorpus | None:
    """The draft corpus kept in a checkpoint directory (`FILE`), or None."""
    if checkpoint is None:
        return None
    path = Path(checkpoint) / FILE
    return DraftCorpus.load(path) if path.is_file() else None


def from_data(data, tokenizer, *, announce=None, max_tokens: int | None = None) -> DraftCorpus:
    """A draft corpus of every record of a data file (what `mars finetune` reads), each encoded as
    training encodes it without the block padding. With `max_tokens`, the records in file order up
    to that many tokens (the index costs about 100 bytes of memory a token once loaded)."""
    from ...train.data import DataError, encode_record, read_split

    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise DataError("the tokenizer names no EOS token, which ends every reply of a draft corpus")
    path, records = read_split(data, "train")
    sequences, total = [], 0
    for lineno, record in records:
        ids = encode_record(record, tokenizer, eos_id=eos_id, where=f"{path}:{lineno}")[0]
        if max_tokens is not None and total + len(ids) > max_tokens:
            if announce is not None:
                announce(
                    f"{path}: the draft corpus keeps the first {len(sequences)} of {len(records)} records "
                    f"(at most {max_tokens:,} tokens)"
                )
            break
        sequences.append(ids)
        total += len(ids)
    corpus = DraftCorpus(sequences)
    if announce is not None:
        announce(f"{len(sequences)} records, {len(corpus)} tokens from {path}")
    return corpus
