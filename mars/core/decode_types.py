"""What the decoding loop and its callers share: the settings, the backend protocol, the
rows being decoded and the statistics they report (docs/method.md §5, §8)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .acceptance import check_metric, check_threshold, is_ar_mode
from .config import MarsConfig

if TYPE_CHECKING:
    from .cost import ThresholdPolicy
    from .drafting import Drafting

STRATEGIES = ("none", "window", "block")
FEEDS = ("auto", "fixed")


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def divisor(self) -> float:
        """What the backends divide the (float32, top-shifted-to-0) logits by: the temperature,
        floored at 1e-30, a normal float32 (1e-69 is 0.0 there and x / 0.0 is NaN); a vanishing
        temperature then sends every logit but the top to -inf, the greedy limit."""
        return max(self.temperature, 1e-30)


@dataclass
class DecodeSettings:
    mask_id: int
    eos_ids: tuple[int, ...]
    block_size: int = MarsConfig.block_size  # B: masks per step; a step accepts at most B + 1 tokens per row
    threshold: float = 1.0
    metric: str = MarsConfig.metric
    max_tokens: int = 256
    cache: str = "window"  # none | window | block
    block_cache: int = 16  # B_cache, slots per aligned block of the block strategy
    sampling: Sampling = field(default_factory=Sampling)
    lossless: bool = False  # masks draft, the next forward verifies: output exactly AR's (docs/method.md §8)
    # The cap on spare groups (`--hedge` sets it). Lossless, greedy, window or no cache: also
    # feed up to this many spare groups of B masks, group g placed after the g-th draft (group 0
    # right after the last verified token) and attending only to what precedes it. When draft
    # g + 1 is the first one rejected, the step still takes the AR token there, and group g's
    # proposals (conditioned on verified tokens only) become the next drafts instead of none.
    # Output stays AR's; only the drafts change. Each group costs B more fed tokens per step.
    # None: B groups (after every draft); 0: no spare groups. See `spare_groups`.
    hedge: int | None = None
    # Lossless, greedy, window or no cache: also draft from n-gram lookup in the prompt and output
    # (mars.core.ngram), up to this many tokens a step (0: off); a row takes, per step, the source
    # expected to keep more. (Sampled drafts need the distribution they came from; lookup has none.)
    ngram: int = 0
    # With `ngram` > 0, also draft from a draft corpus (mars.core.corpus.DraftCorpus: the
    # model's own earlier replies, e.g. the checkpoint's draft_corpus.npz), up to `ngram`
    # tokens a step, chosen per step beside the other sources; None: no corpus drafts.
    corpus: Any = field(default=None, repr=False, compare=False)
    # Lossless, greedy, window or no cache: also feed, for a row's first draft, up to this many
    # runners-up (the next most likely tokens where that draft came from), each as an
    # alternative group: the runner-up at the first draft's position, then B masks, attending
    # only to the verified tokens before it (a plain window ending at the runner-up). When the
    # first draft is rejected and AR's token there is a runner-up, the step also takes AR's
    # token after it (computed by its group) and its group's proposals become the next drafts.
    # Output stays AR's. Each group costs 1 + B fed tokens a step (0: off).
    alternatives: int = 0
    # What a caller with a cost curve (mars.session.Session, `mars bench`) lets the loop choose
    # per step: "auto", the masks (and spare groups) fed, from what a forward costs on the
    # device (mars.core.cost; lossless output stays AR's, threshold-mode text may then depend
    # on the device and the batch); "fixed", always B masks (and `hedge` spare groups).
    feed: str = "auto"
    # Threshold mode below AR mode, greedy: verified threshold mode (docs/method.md §9). Run
    # lossless mode's loop (drafts from the masks, the spare groups and n-gram lookup, fed and
    # kept where AR agrees; the window cache, or none) and also take, after each step's AR
    # token, the leading next drafts whose confidence passes the threshold, unverified. Tokens
    # differ from AR's only where such a draft was taken; the drafts it did not take are
    # verified instead of dropped. Ignored in AR mode, in lossless mode and when sampling.
    verify: bool = False

    def __post_init__(self):
        check_metric(self.metric)
        self.threshold = check_threshold(self.metric, self.threshold)
        if self.cache not in STRATEGIES:
            raise ValueError(f"cache must be one of {', '.join(STRATEGIES)}, got {self.cache!r}")
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        if self.block_cache < 1:
            raise ValueError(f"block cache size must be >= 1, got {self.block_cache}")
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {self.max_tokens}")
        if self.hedge is not None and self.hedge < 0:
            raise ValueError(f"hedge must be >= 0 spare mask groups, got {self.hedge}")
        if self.alternatives < 0:
            raise ValueError(f"alternatives must be >= 0 runner-up drafts, got {self.alternatives}")
        if self.ngram < 0:
            raise ValueError(f"n-gram drafts must be >= 0, got {self.ngram}")
        if self.feed not in FEEDS:
            raise ValueError(f"feed must be one of {', '.join(FEEDS)}, got {self.feed!r}")

    @property
    def not_verified(self) -> str | None:
        """Why `verify` does nothing here, or None when it runs (see `verify`)."""
        if self.lossless:
            return "lossless mode verifies every draft already"
        if not self.sampling.greedy:
            return "verified threshold mode is greedy (a sampled draft's check needs the distribution it came from)"
        if self.masks_per_step == 0:
            return "AR mode takes no mask's guess"
        return None

    @property
    def verified(self) -> bool:
        """Verified threshold mode runs (`verify`, and nothing rules it out)."""
        return self.verify and self.not_verified is None

    @property
    def no_spare_groups(self) -> str | None:
        """Why this run feeds no spare groups whatever `hedge` says, or None when it may:
        greedy lossless with the window cache or none only (a sampled draft's acceptance needs
        the distribution it was drawn from; spare groups would need theirs kept too)."""
        if not (self.lossless or self.verified):
            return "spare mask groups are a lossless-mode (and verified threshold mode) feature"
        if not self.sampling.greedy:
            return "lossless sampling runs without spare mask groups (they apply to greedy decoding)"
        if self.cache == "block":
            return "the block cache runs without spare mask groups (they need the window cache or none)"
        return None

    @property
    def spare_groups(self) -> int:
        """Spare groups a window step feeds (see `hedge` and `no_spare_groups`)."""
        if self.no_spare_groups:
            return 0
        return self.block_size if self.hedge is None else min(self.hedge, self.block_size)

    @property
    def alternative_groups(self) -> int:
        """Alternative groups a window step may feed (see `alternatives`): where spare groups
        may be fed (`no_spare_groups`), `alternatives`, else none."""
        return 0 if self.no_spare_groups else self.alternatives

    @property
    def window_spare_groups(self) -> int:
        """The spare groups these settings feed with the window cache: `spare_groups`, also
        where greedy lossless decoding leaves the block cache for the window cache."""
        return replace(self, cache="window").spare_groups

    @property
    def masks_per_step(self) -> int:
        # In AR mode the masks could never be accepted: feed none (a one-slot window).
        # Lossless mode ignores the threshold: its masks only draft.
        if self.lossless:
            return self.block_size
        return 0 if is_ar_mode(self.metric, self.threshold) else self.block_size


class StepBackend(Protocol):
    """What the loop needs from a backend (see mars/backends/base.py)."""

    def new_cache(self, batch: int) -> Any: ...

    def crop(self, cache: Any, length: int) -> None: ...

    def step(self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None, runners_up: int = 0):
        """Forward `input_ids` (b, q) at `positions` on top of `cache` (None: no cache)
        under `mask` (b, q, kv) bool or None (plain causal, no holes); return
        (ids, confidence), each (b, k), for the outputs at `read` (b, k) indices into q.
        `metric` None (greedy AR): the argmax ids alone; confidences may be zeros.
        `valid` (b, q), when given, marks the real positions: the others are holes, never
        attended nor read, which a backend may leave uncomputed (`skips_holes`).
        `runners_up` n > 0 (greedy): also return, third, (b, k, n) the next n ids of each
        read after its chosen one, most likely first (`runners_up_of`)."""
        ...

    def keep_rows(self, cache, rows: list[int]) -> None:
        """Keep only these batch rows of the cache (None: no cache) and of any per-row state
        kept for speculate."""
        ...

    def speculate(self, cache, input_ids, positions, mask, read, drafts, n_drafts, *, sampling) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Lossless sampling, on the device. `read` (b, 1 + D + m): the outputs before each of
        the D draft slots and after the last (AR), then the m masks. Row r's first
        `n_drafts[r]` ids of `drafts` (b, D) were drawn by the previous call from its mask
        distributions q, which the backend kept. Returns (kept (b,), token (b,), new drafts
        (b, m)): drafts kept by the speculative-sampling rule (accept with min(1, p/q)), then
        a token drawn from norm(max(0, p - q)) at the first rejection, or from p after the
        last draft; new drafts are drawn from this step's mask distributions, kept for the next call."""
        ...


def sum_ragged(lists) -> list[int]:
    """Element-wise sum of count lists of different lengths (the shorter ones padded with
    zeros): rows whose n-gram drafts outnumbered the masks count more slots than the others."""
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
    # Lossless mode: tokens taken, by where they came from: drafts of the masks, of the spare
    # groups or of n-gram lookup (kept by verification), and the AR token every step takes.
    by_source: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_forward(self) -> float:
        return self.accepted / self.forwards if self.forwards else 0.0


@dataclass
class DecodeStats:
    rows: list[RowStats]
    forwards: int = 0  # batch forwards run
    fed_tokens: int = 0  # token slots fed, holes included (the compute spent)
    drafting: Drafting | None = field(default=None, repr=False)  # greedy lossless window decoding
    threshold_feed: ThresholdPolicy | None = field(default=None, repr=False)  # cost-aware threshold mode
    masks_fed: dict[int, int] = field(default_factory=dict)  # threshold mode: masks fed a step -> steps
    # The cache strategy that ran: the one asked for, or "window" where greedy lossless
    # decoding with the block cache was expected to be slower than with the window cache.
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
                        {"drafted_per_slot": r.drafted_per_slot, "verified_per_slot": r.verified_per_slot, "kept_per_slot": r.kept_per_slot}
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

        return {"drafted_per_slot": total("drafted_per_slot"), "verified_per_slot": total("verified_per_slot"), "kept_per_slot": total("kept_per_slot")}

    def by_source(self) -> dict[str, int]:
        """Lossless mode: tokens taken per source (masks, spare, ngram, ar), summed over rows."""
        out: dict[str, int] = {}
        for r in self.rows:
            for k, v in r.by_source.items():
                out[k] = out.get(k, 0) + v
        return out


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # generated ids per row, an accepted EOS included
    finish: list[str]  # "eos" or "length"
    stats: DecodeStats


class Row:
    """One sequence being decoded: its prompt and accepted output, how much of it the cache
    holds, whether and why it finished, its drafts (lossless) and its statistics. A served
    batch (`ContinuousBatch.join`) hands rows to its caller, who reads `out`, `done`,
    `finish`, `stats` and `threshold`, and may set `threshold` between steps."""

    def __init__(self, prompt: list[int], slots: int, *, threshold: float, max_tokens: int):
        self.seq = list(prompt)  # prompt + accepted output
        self.prompt_len = len(prompt)
        self.threshold = threshold  # per row: the rows of a served batch differ (ContinuousBatch)
        self.max_tokens = max_tokens
        self.cached = 0  # real tokens of `seq` already in the cache
        self.done = False
        self.finish = ""
        self.drafts: list[int] = []  # lossless: the last proposals, verified next step
        self.source = "masks"  # where `drafts` came from: masks | spare | ngram | corpus | alt
        self.alts: list[int] = []  # lossless: runners-up for drafts[0] (DecodeSettings.alternatives)
        self.stats = RowStats(accepted_per_slot=[0] * slots)

    @property
    def out(self) -> list[int]:
        return self.seq[self.prompt_len :]


def runners_up_of(top: np.ndarray, chosen: np.ndarray, n: int) -> np.ndarray:
    """(b, k, n) the n most likely ids of each read other than its chosen one, from `top`
    (b, k, n + 1), the n + 1 most likely ids, most likely first. The chosen id (the argmax)
    is usually top's first; where a tie put it elsewhere, it is left out all the same."""
    other = top != chosen[..., None]
    order = np.argsort(~other, axis=-1, kind="stable")  # the others first, in their order
    return np.take_along_axis(top, order, axis=-1)[..., :n]
