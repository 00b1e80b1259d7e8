"""The plan a request decodes by (docs/method.md §5, §8, §9): its mode, named once, and the
one function every entry point (generate, chat, serve, bench, eval, distill, the Python
session) turns a checkpoint's defaults and a request's options into a plan with.

A plan is a `DecodeSettings`: the mode (`Mode`, `DecodeSettings.mode`), the threshold and
metric, the block size, the cache, the sampling, the feed and the draft sources in use
(spare groups, runner-up alternatives, n-gram lookup, a draft corpus). `DecodeSettings.name`
is the one printable name of a run's mode: `mars generate --json` prints it as "mode",
chat after each reply, bench and eval in their rows, and the server in `usage.mode`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..acceptance import check_metric, check_threshold, is_ar_mode
from ..config import MarsConfig
from .rules import block_size_for, check_may_decode, checkpoint_mode, metric_for


class Mode(enum.Enum):
    """How a run takes tokens (docs/method.md §5, §8, §9)."""

    AR = "ar"  # one token a forward, the model's own greedy (or sampled) choice
    THRESHOLD = "threshold"  # also the leading masks whose confidence passes the threshold
    VERIFIED = "verified"  # threshold mode that also verifies the drafts it does not take
    LOSSLESS = "lossless"  # the masks (and other sources) draft, the next forward verifies: AR's output


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
    # (mars.core.decode.drafts.ngram), up to this many tokens a step (0: off); a row takes, per step, the source
    # expected to keep more. (Sampled drafts need the distribution they came from; lookup has none.)
    ngram: int = 0
    # With `ngram` > 0, also draft from a draft corpus (mars.core.decode.drafts.corpus.DraftCorpus: the
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
    # device (mars.core.decode.cost; lossless output stays AR's, threshold-mode text may then depend
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

    @property
    def mode(self) -> Mode:
        """The mode this plan runs in."""
        if self.lossless:
            return Mode.LOSSLESS
        if self.masks_per_step == 0:
            return Mode.AR
        return Mode.VERIFIED if self.verified else Mode.THRESHOLD

    @property
    def name(self) -> str:
        """The mode's printable name, the same wherever a run reports it."""
        mode, sampling = self.mode, self.sampling
        how = "greedy" if sampling.greedy else f"sampling (temp {sampling.temperature:g})"
        if mode is Mode.LOSSLESS:
            return f"lossless {how}"
        if mode is Mode.AR:
            return f"AR {how}"
        return f"{'verified ' if mode is Mode.VERIFIED else ''}threshold {self.threshold:g} ({self.metric})"


def decode_plan(mars: MarsConfig | None, *, mask_id: int, eos_ids, threshold: float | None = None, lossless: bool = False,
                verify: bool | None = None, metric: str | None = None, block_size: int | None = None, force: bool = False,
                warn: Callable[[str], None] | None = None, **fields) -> DecodeSettings:
    """The plan for a checkpoint (`mars`, None for a model without mars.json) and a request:
    the metric and block size default to the checkpoint's; with no threshold the checkpoint's
    default mode applies (mars.json default_threshold, lossless when its default_mode says
    so); greedy threshold mode is verified unless `verify` is False; a model without
    mars.json is held to AR mode or lossless decoding unless `force`. `fields`: the other
    DecodeSettings fields (max_tokens, cache, sampling, feed, the draft sources...)."""
    metric = metric_for(mars, metric)
    if threshold is not None:
        threshold = check_threshold(metric, threshold)
    threshold, lossless = checkpoint_mode(mars, metric, threshold, lossless)
    check_may_decode(mars is not None, metric, threshold, lossless=lossless, force=force, warn=warn)
    return DecodeSettings(mask_id=mask_id, eos_ids=tuple(eos_ids), block_size=block_size_for(mars, block_size), threshold=threshold,
                          metric=metric, lossless=lossless, verify=verify is not False, **fields)
