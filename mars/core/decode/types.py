"""What the decoding loop and its callers share (docs/method.md §5, §8): the backend protocol, the
rows being decoded and the statistics they report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .drafts import MASKS, SPARE


class StepBackend(Protocol):
    """What the loop needs from a backend (see mars/backends/base.py)."""

    def new_cache(self, batch: int) -> Any: ...

    def crop(self, cache: Any, length: int) -> None: ...

    def step(
        self,
        cache,
        input_ids,
        positions,
        mask,
        read,
        *,
        metric,
        sampling,
        valid=None,
        runners_up=0,
        runners_up_from=0,
        logprobs=None,
    ):
        """Forward `input_ids` (b, q) at `positions` on `cache` (None: no cache) under `mask` (b, q, kv)
        bool or None (plain causal, no holes); return a StepOutput: the ids and confidences, each (b, k),
        of the outputs at `read` (b, k) indices into q. `metric` None (greedy AR): the argmax ids alone,
        confidences may be zeros. `valid` (b, q), when given, marks the real positions: the others are
        holes, never attended nor read, which a backend may leave uncomputed (`skips_holes`).
        `runners_up` n > 0 (greedy): also (`runners_up`) (b, k, n) the next n ids of each read after its
        chosen one, wanted at reads `runners_up_from` on (the reads before may have none: -1).
        `logprobs` n (not None): also (`logprobs`) a ReadLogprobs of the reads with n top
        ids each. A backend whose `takes_rows` is True is given `input_ids`, `positions`, `read` and
        `valid` as lists of rows (the loop's own), and a StepMask's `see` and `start` may be lists of
        rows for any backend."""
        ...

    def keep_rows(self, cache, rows: list[int]) -> None:
        """Keep only these batch rows of the cache (None: no cache) and of any per-row state
        kept for speculate."""
        ...

    def speculate(
        self, cache, input_ids, positions, mask, read, drafts, n_drafts, *, sampling, logprobs=None, tree=None, ranks=0
    ) -> Speculated:
        """Lossless sampling, on the device. `read` (b, 1 + D + m): the outputs before each of the D
        draft slots and after the last (AR), then the m masks. Row r's first `n_drafts[r]` ids of
        `drafts` (b, D) were drawn by the previous call from its mask distributions q, which the backend
        kept. Returns a Speculated: `kept` (b,), `token` (b,), the new drafts `proposals` (b, m): drafts
        kept with chance min(1, p/q),
        then a token drawn from norm(max(0, p - q)) at the first rejection, or from p after the last
        draft; the new drafts are drawn from this step's mask distributions, kept for the next call.

        `tree` (a SampledTree): the reads go on with each node's, then its m masks'; where the chain
        was rejected at a node's anchor the nodes there are tried by `tree_sampling`, and where one is
        taken it is the token, a token `after` it is drawn at its read and the new drafts from its
        masks; also `node` taken (b,), -1 for none, and `after` (b,).
        `logprobs` n (not None): also (`logprobs`) a ReadLogprobs of the first 1 + D reads (then, with a
        tree, the taken node's read) whose chosen ids are the drafts kept, the token (and `after`).
        `ranks` k > 0: also (`ranks`) a ReadLogprobs of the reads the new drafts were drawn at, whose
        chosen ids are the new drafts, with k top ids each (untempered)."""
        ...


def error_line(error: BaseException, limit: int = 200) -> str:
    """An error as one line: its type and the first line of its message, cut at `limit` characters."""
    first = (str(error).strip().splitlines() or [""])[0][:limit]
    return f"{type(error).__name__}: {first}"


def compile_failed(error: BaseException) -> str:
    """What a backend's `on_compile_error` hears when its compiled step raised `error` and it
    decodes eager instead (`--compile auto`)."""
    return (
        f"the compiled decoding step failed ({error_line(error)}); decoding eager instead "
        "(--compile on shows the whole error)"
    )


@dataclass(frozen=True)
class StepOutput:
    """What StepBackend.step returns, on the host, the same fields whatever was asked: per read the
    chosen `ids` (b, k) and their confidences `conf` (b, k; zeros where no metric was asked), the
    `runners_up` (b, k, n) where n > 0 was asked, the reads' `logprobs` where asked (else None)."""

    ids: np.ndarray
    conf: np.ndarray
    runners_up: np.ndarray | None = None
    logprobs: ReadLogprobs | None = None

    def __iter__(self):
        """Unpacks as (ids, conf), whatever else was asked."""
        return iter((self.ids, self.conf))


@dataclass(frozen=True)
class Speculated:
    """What StepBackend.speculate returns, on the host, the same fields whatever was asked: per row the
    drafts `kept` (b,), the `token` drawn after them (b,), the new drafts `proposals` (b, m); with a
    tree, the `node` taken (b,; -1 for none) and the token drawn `after` it (b,); the reads'
    `logprobs` and the new drafts' `ranks` where asked (else None)."""

    kept: np.ndarray
    token: np.ndarray
    proposals: np.ndarray
    node: np.ndarray | None = None
    after: np.ndarray | None = None
    logprobs: ReadLogprobs | None = None
    ranks: ReadLogprobs | None = None


@dataclass(frozen=True)
class SampledTree:
    """A sampled step's token tree (drafts/tree.py) for StepBackend.speculate: row r's node j, id
    `nodes[r, j]`, follows its first `anchors[r, j]` drafts where `live[r, j]`; each node feeds its id,
    then `masks` masks, after the chain's masks, in that order."""

    nodes: np.ndarray  # (b, K) int64
    anchors: np.ndarray  # (b, K) int64
    live: np.ndarray  # (b, K) bool
    masks: int


@dataclass
class ReadLogprobs:
    """What a step read, as log-probabilities (StepBackend.step and speculate with `logprobs` n): per
    read, the id returned (or taken) there under the model's untempered distribution at that read, and
    the n most likely ids there with theirs, most likely first."""

    chosen: np.ndarray  # (b, k) float32
    top_ids: np.ndarray  # (b, k, n) int64
    top: np.ndarray  # (b, k, n) float32

    def entry(self, i: int, j: int) -> TokenLogprob:
        """Row i's read j as one token's entry."""
        top = [(int(t), float(v)) for t, v in zip(self.top_ids[i, j], self.top[i, j])]
        return TokenLogprob(float(self.chosen[i, j]), top)


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the distribution it was taken from, and the most
    likely ids there with theirs."""

    logprob: float
    top: list[tuple[int, float]]


def sum_ragged(lists) -> list[int]:
    """Element-wise sum of count lists of different lengths (rows may draft more slots than B)."""
    out: list[int] = []
    for counts in lists:
        out.extend([0] * (len(counts) - len(out)))
        for j, c in enumerate(counts):
            out[j] += int(c)
    return out


@dataclass
class RowStats:
    forwards: int = 0  # forwards that produced at least one token for this row
    waited: int = 0  # forwards in which the row was unfinished but took nothing
    accepted: int = 0
    accepted_per_slot: list[int] = field(default_factory=list)
    # Lossless mode, per draft slot: proposed by the masks, fed for verification, kept.
    drafted_per_slot: list[int] = field(default_factory=list)
    verified_per_slot: list[int] = field(default_factory=list)
    kept_per_slot: list[int] = field(default_factory=list)
    # Lossless mode: tokens taken per draft source (kept drafts), and "ar", the AR token of every step.
    by_source: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_forward(self) -> float:
        return self.accepted / self.forwards if self.forwards else 0.0


@dataclass
class DecodeStats:
    rows: list[RowStats]
    forwards: int = 0  # batch forwards run
    fed_tokens: int = 0  # token slots fed, holes included (the compute spent)
    masks_fed: dict[int, int] = field(default_factory=dict)  # threshold mode: masks fed a step -> steps
    # The measured feed's choices: (masks, spare groups) -> steps; empty with a fixed feed.
    feed_choices: dict[tuple[int, int], int] = field(default_factory=dict)
    # The drafting statistics after the run, per source and slot (mars.core.decode.feed.DraftStats).
    draft_reached: dict[str, list[int]] = field(default_factory=dict)
    draft_kept: dict[str, list[int]] = field(default_factory=dict)
    # The cache strategy that ran: the one asked for, or "window" where the block cache would not pay.
    cache: str | None = None

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rows)

    @property
    def row_forwards(self) -> int:
        return sum(r.forwards for r in self.rows)

    @property
    def tokens_per_forward(self) -> float:
        """Accepted tokens / counted forwards, summed over rows (docs/method.md §5, Counting)."""
        return self.accepted / self.row_forwards if self.row_forwards else 0.0

    def to_dict(self) -> dict:
        return {
            "cache": self.cache,
            "forwards": self.forwards,
            "fed_tokens": self.fed_tokens,
            "accepted": self.accepted,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "rows": [
                {
                    "forwards": r.forwards,
                    "waited": r.waited,
                    "accepted": r.accepted,
                    "tokens_per_forward": round(r.tokens_per_forward, 4),
                    "accepted_per_slot": r.accepted_per_slot,
                    **(
                        {
                            "drafted_per_slot": r.drafted_per_slot,
                            "verified_per_slot": r.verified_per_slot,
                            "kept_per_slot": r.kept_per_slot,
                        }
                        if r.drafted_per_slot
                        else {}
                    ),
                    **({"by_source": dict(r.by_source)} if r.by_source else {}),
                }
                for r in self.rows
            ],
        }

    def draft_totals(self) -> dict:
        """Lossless mode: drafts proposed, verified and kept, per draft slot, summed over rows."""

        def total(name):
            return sum_ragged(getattr(r, name) for r in self.rows)

        return {
            "drafted_per_slot": total("drafted_per_slot"),
            "verified_per_slot": total("verified_per_slot"),
            "kept_per_slot": total("kept_per_slot"),
        }

    def by_source(self) -> dict[str, int]:
        """Lossless mode: tokens taken per source (masks, spare, ngram, ar), summed over rows."""
        out: dict[str, int] = {}
        for r in self.rows:
            for k, v in r.by_source.items():
                out[k] = out.get(k, 0) + v
        return out


MASK_SOURCES = (MASKS, SPARE, "threshold")  # what the masks bring: drafts, spare groups, unverified threshold tokens


def masks_share(sources: dict[str, int] | None) -> float | None:
    """The masks' share of the extra tokens: those of `MASK_SOURCES` over every token not computed as
    AR's own; None without extra tokens."""
    if not sources:
        return None
    extra = sum(n for k, n in sources.items() if k != "ar")
    if not extra:
        return None
    return sum(sources.get(k, 0) for k in MASK_SOURCES) / extra


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # generated ids per row, an accepted EOS included
    finish: list[str]  # "eos" or "length"
    stats: DecodeStats
    logprobs: list[list[TokenLogprob]] | None = None  # per row and token, where the plan asked for them


class Row:
    """One sequence being decoded: its prompt and accepted output, how much of it the cache holds,
    whether and why it finished, its drafts and its statistics."""

    def __init__(self, prompt: list[int], slots: int, *, threshold: float, max_tokens: int):
        self.seq = list(prompt)  # prompt + accepted output
        self.prompt_len = len(prompt)
        self.threshold = threshold  # per row: the rows of a served batch differ (ContinuousBatch)
        self.max_tokens = max_tokens
        self.cached = 0  # real tokens of `seq` already in the cache
        self.done = False
        self.finish = ""
        self.drafts: list[int] = []  # lossless: the last proposals, verified next step
        self.source = MASKS  # where `drafts` came from: masks | spare | ngram | corpus | alt
        self.alts: list[int] = []  # lossless: runners-up for drafts[0] (DraftSources.alternatives)
        # Lossless: the tree's branches (drafts/tree.py) and the chain of drafts they leave.
        self.branches: list[tuple[int, list[int], float]] = []
        self.tree_chain: list[int] = []
        # Lossless: the step's tree off the chain it feeds, (anchor, prefix, weight) (drafts/tree.paths).
        self.paths: list[tuple[int, list[int], float]] = []
        self.logprobs: list[TokenLogprob] = []  # per token of `out`, where the plan asks for them
        self.stats = RowStats(accepted_per_slot=[0] * slots)

    @property
    def out(self) -> list[int]:
        return self.seq[self.prompt_len :]

    @property
    def produced(self) -> int:
        """len(out), without copying the reply (asked per row every step)."""
        return len(self.seq) - self.prompt_len


def runners_up_of(top: np.ndarray, chosen: np.ndarray, n: int) -> np.ndarray:
    """(b, k, n) the n most likely ids of each read other than its chosen one, from `top`
    (b, k, n + 1), the n + 1 most likely ids, most likely first. The chosen id (the argmax)
    is usually top's first; where a tie put it elsewhere, it is left out all the same."""
    if (top[..., 0] == chosen).all():  # the argmax first everywhere (top's ids are distinct): the rest follow it
        return top[..., 1 : n + 1]
    other = top != chosen[..., None]
    order = np.argsort(~other, axis=-1, kind="stable")  # the others first, in their order
    return np.take_along_axis(top, order, axis=-1)[..., :n]
