"""The plan a request decodes by (docs/method.md §5, §8, §9): `Plan` and its `Mode`, and
`make_plan`, the one function that turns a checkpoint's defaults and a request's options into a
plan. `Plan.name` is the one printable name of a run's mode, wherever a run reports it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..acceptance import ar_threshold, check_metric, check_threshold, is_ar_mode
from ..config import MarsConfig
from .rules import block_size_for, check_may_decode, checkpoint_mode, metric_for


class Mode(enum.Enum):
    """How a run takes tokens (docs/method.md §5, §8, §9)."""

    AR = "ar"  # one token a forward, the model's own greedy (or sampled) choice
    THRESHOLD = "threshold"  # also the leading masks whose confidence passes the threshold
    VERIFIED = "verified"  # threshold mode that also verifies the drafts it does not take
    LOSSLESS = "lossless"  # the masks (and other sources) draft, the next forward verifies: AR's output


MAX_LOGPROBS = 20  # the most likely ids a token's logprobs may list (the OpenAI API's top_logprobs bound)
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


# The most tree nodes a step of `tree="auto"` may feed, where a cost-aware feed sizes them per step. (32
# took the flat curve's default mode from 2.735 to 2.765 tokens per forward against 16, when the masks'
# 8 ranked guesses gave about 28 candidates a step; benchmarks/README.md "Token trees".)
AUTO_TREE = 32


@dataclass(frozen=True)
class DraftSources:
    """The draft sources a plan may feed beside the masks (docs/method.md §9), each a proposer in
    mars.core.decode.drafts, where the plan verifies drafts, greedy, on the window cache or none."""

    # The most spare groups a step feeds (drafts/spare.py, `--hedge`); None: B, one after every draft.
    hedge: int | None = None
    # The most runners-up of a first draft fed as alternative groups (drafts/alternatives.py); 0: off.
    alternatives: int = 0
    # The most n-gram lookup drafts (drafts/ngram.py) a step feeds (0: off).
    ngram: int = 0
    # With `ngram` > 0, a draft corpus (drafts/corpus.py) to draft up to `ngram` tokens a step from.
    corpus: Any = field(default=None, repr=False, compare=False)
    # The most tree nodes (drafts/tree.py: the masks' runners-up off the chain of drafts) a step feeds; 0: off;
    # "auto": up to AUTO_TREE where a cost-aware feed sizes them per step (Drafting), none elsewhere.
    tree: int | str = "auto"

    def __post_init__(self):
        if self.hedge is not None and self.hedge < 0:
            raise ValueError(f"hedge must be >= 0 spare mask groups, got {self.hedge}")
        if self.alternatives < 0:
            raise ValueError(f"alternatives must be >= 0 runner-up drafts, got {self.alternatives}")
        if self.ngram < 0:
            raise ValueError(f"n-gram drafts must be >= 0, got {self.ngram}")
        if self.tree != "auto" and (isinstance(self.tree, str) or self.tree < 0):
            raise ValueError(f"tree nodes must be >= 0 or 'auto', got {self.tree!r}")


@dataclass(frozen=True)
class Plan:
    """A plan, made by `make_plan` (or built whole, as the tests do) and never changed: a new mode or
    threshold makes a new plan (`replan`). `mode` must agree with the threshold: AR mode at the
    metric's AR threshold, threshold and verified threshold mode below it; lossless ignores it."""

    mask_id: int
    eos_ids: tuple[int, ...]
    mode: Mode = Mode.AR
    block_size: int = MarsConfig.block_size  # B: masks per step; a step accepts at most B + 1 tokens per row
    threshold: float = 1.0
    metric: str = MarsConfig.metric
    max_tokens: int = 256
    cache: str = "window"  # none | window | block
    block_cache: int = 16  # B_cache, slots per aligned block of the block strategy
    sampling: Sampling = field(default_factory=Sampling)
    drafts: DraftSources = field(default_factory=DraftSources)
    # "auto": where the caller has cost curves, each step's masks (and spare groups) are chosen from
    # them (mars.core.decode.feed); "fixed": always B masks (and `hedge` spare groups).
    feed: str = "auto"
    # The loaded model's number format. Lossless output equals AR's exactly in float32, and up to
    # near-ties of AR's two best logits in narrower formats (the mode's name says so).
    numerics: str = "float32"
    # Also keep each generated token's log-probability and the `logprobs` most likely ids at its place
    # (None: none kept); what is generated does not change.
    logprobs: int | None = None

    def __post_init__(self):
        check_metric(self.metric)
        object.__setattr__(self, "threshold", check_threshold(self.metric, self.threshold))
        object.__setattr__(self, "eos_ids", tuple(self.eos_ids))
        if not isinstance(self.mode, Mode):
            raise ValueError(f"mode must be a Mode ({', '.join(m.name for m in Mode)}), got {self.mode!r}")
        if self.cache not in STRATEGIES:
            raise ValueError(f"cache must be one of {', '.join(STRATEGIES)}, got {self.cache!r}")
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        if self.block_cache < 1:
            raise ValueError(f"block cache size must be >= 1, got {self.block_cache}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be 0 to {MAX_LOGPROBS} most likely ids, got {self.logprobs}")
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {self.max_tokens}")
        if self.feed not in FEEDS:
            raise ValueError(f"feed must be one of {', '.join(FEEDS)}, got {self.feed!r}")
        ar = is_ar_mode(self.metric, self.threshold)
        if self.mode is Mode.AR and not ar:
            raise ValueError(f"AR mode decodes at threshold {ar_threshold(self.metric)}, not {self.threshold:g}")
        if self.mode in (Mode.THRESHOLD, Mode.VERIFIED) and ar:
            raise ValueError(f"{self.mode.value} mode needs a threshold below AR mode's {self.threshold:g}")
        if self.mode is Mode.VERIFIED:
            if not self.sampling.greedy:
                raise ValueError(
                    "verified threshold mode is greedy (a sampled draft's check needs the distribution it came from)"
                )
            if self.cache == "block":
                raise ValueError("verified threshold mode runs on the window cache or none, not the block cache")

    @property
    def verifies(self) -> bool:
        """The loop feeds drafts and verifies them (lossless and verified threshold mode)."""
        return self.mode in (Mode.LOSSLESS, Mode.VERIFIED)

    @property
    def no_spare_groups(self) -> str | None:
        """Why this run feeds no spare groups whatever `hedge` says, or None when it may."""
        if not self.verifies:
            return "spare mask groups are a lossless-mode (and verified threshold mode) feature"
        if not self.sampling.greedy:
            return "lossless sampling runs without spare mask groups (they apply to greedy decoding)"
        if self.cache == "block":
            return "the block cache runs without spare mask groups (they need the window cache or none)"
        return None

    @property
    def spare_groups(self) -> int:
        """Spare groups a window step feeds (see DraftSources.hedge and `no_spare_groups`)."""
        if self.no_spare_groups:
            return 0
        hedge = self.drafts.hedge
        return self.block_size if hedge is None else min(hedge, self.block_size)

    @property
    def alternative_groups(self) -> int:
        """Alternative groups a window step may feed: `alternatives` where spare groups may be fed."""
        return 0 if self.no_spare_groups else self.drafts.alternatives

    @property
    def tree_nodes(self) -> int:
        """Tree nodes a step may feed: `tree` where drafts are verified (greedy or sampled, any cache);
        "auto" is decided per run (mars.core.decode.execution), none until then."""
        return self.drafts.tree if self.verifies and self.drafts.tree != "auto" else 0

    @property
    def lookup_drafts(self) -> int:
        """The most drafts a step takes from lookup: greedy only (a sampled draft needs the
        distribution it came from), where drafts are verified."""
        return self.drafts.ngram if self.verifies and self.sampling.greedy else 0

    @property
    def window_spare_groups(self) -> int:
        """`spare_groups` on the window cache, where greedy lossless decoding may leave the block cache."""
        return replace(self, cache="window").spare_groups

    @property
    def masks_per_step(self) -> int:
        """Masks a step feeds: none in AR mode (they could never be accepted), else B."""
        return 0 if self.mode is Mode.AR else self.block_size

    @property
    def name(self) -> str:
        """The mode's printable name, the same wherever a run reports it."""
        mode, sampling = self.mode, self.sampling
        how = "greedy" if sampling.greedy else f"sampling (temp {sampling.temperature:g})"
        if mode is Mode.LOSSLESS:
            return f"lossless {how}" + (
                "" if self.numerics == "float32" else f" ({self.numerics}: AR's up to near-ties)"
            )
        if mode is Mode.AR:
            return f"AR {how}"
        return f"{'verified ' if mode is Mode.VERIFIED else ''}threshold {self.threshold:g} ({self.metric})"


def why_not_verified(plan: Plan) -> str | None:
    """Why a plan asked to verify (greedy threshold mode's default) is not in verified
    threshold mode, or None when it is."""
    if plan.mode is Mode.VERIFIED:
        return None
    if plan.mode is Mode.LOSSLESS:
        return "lossless mode verifies every draft already"
    if not plan.sampling.greedy:
        return "verified threshold mode is greedy (a sampled draft's check needs the distribution it came from)"
    return "AR mode takes no mask's guess"


def choose_mode(metric: str, threshold: float, *, lossless: bool, verify: bool | None, sampling: Sampling) -> Mode:
    """The one rule that names a run's mode (docs/method.md §5, §8, §9): lossless when asked;
    AR at the metric's AR threshold; below it verified threshold mode when greedy, unless
    `verify` is False; else threshold mode."""
    if lossless:
        return Mode.LOSSLESS
    if is_ar_mode(metric, threshold):
        return Mode.AR
    if verify is not False and sampling.greedy:
        return Mode.VERIFIED
    return Mode.THRESHOLD


def make_plan(
    mars: MarsConfig | None,
    *,
    mask_id: int,
    eos_ids,
    threshold: float | None = None,
    lossless: bool | None = None,
    verify: bool | None = None,
    metric: str | None = None,
    block_size: int | None = None,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
    default_mode: Mode | None = None,
    default_threshold: float | None = None,
    hedge: int | None = None,
    alternatives: int = 0,
    tree: int | str = "auto",
    ngram: int = 0,
    corpus: Any = None,
    drafts: DraftSources | None = None,
    feed: str | None = "auto",
    **fields,
) -> Plan:
    """The plan for a checkpoint (`mars`, None for a model without mars.json) and a request; the only
    place a mode is chosen (`choose_mode`). Unasked, the metric and block size are the checkpoint's,
    and with no threshold the default mode applies: a server's (`default_mode` at
    `default_threshold`), else the checkpoint's. The draft sources come as `drafts` or as their
    fields; `feed` None: fixed where a lossless plan names its spare groups (`hedge`), else auto;
    `fields`: the other Plan fields. Verified threshold mode never runs on the block cache."""
    metric = metric_for(mars, metric)
    if threshold is not None:
        threshold = check_threshold(metric, threshold)
    if threshold is None and default_mode is not None:
        lossless = default_mode is Mode.LOSSLESS if lossless is None else lossless
        threshold = check_threshold(metric, ar_threshold(metric) if default_threshold is None else default_threshold)
    threshold, lossless = checkpoint_mode(mars, metric, threshold, bool(lossless))
    check_may_decode(mars is not None, metric, threshold, lossless=lossless, force=force, warn=warn)
    sampling = fields.get("sampling") or Sampling()
    mode = choose_mode(metric, threshold, lossless=lossless, verify=verify, sampling=sampling)
    if mode is Mode.VERIFIED and fields.get("cache") == "block":
        fields["cache"] = "window"
    if drafts is None:
        drafts = DraftSources(hedge=hedge, alternatives=alternatives, ngram=ngram, corpus=corpus, tree=tree)
    if feed is None:
        feed = "fixed" if mode is Mode.LOSSLESS and drafts.hedge is not None else "auto"
    return Plan(
        mask_id=mask_id,
        eos_ids=tuple(eos_ids),
        mode=mode,
        block_size=block_size_for(mars, block_size),
        threshold=threshold,
        metric=metric,
        drafts=drafts,
        feed=feed,
        **fields,
    )


def replan(plan: Plan, mars: MarsConfig | None, **asked) -> Plan:
    """A new plan through `make_plan` for the same checkpoint (`mars`) and request as `plan` but for
    what `asked` changes (threshold, lossless, verify, force...)."""
    request = dict(
        mask_id=plan.mask_id,
        eos_ids=plan.eos_ids,
        metric=plan.metric,
        block_size=plan.block_size,
        max_tokens=plan.max_tokens,
        cache=plan.cache,
        block_cache=plan.block_cache,
        sampling=plan.sampling,
        feed=plan.feed,
        drafts=plan.drafts,
        numerics=plan.numerics,
        logprobs=plan.logprobs,
        lossless=plan.mode is Mode.LOSSLESS,
        threshold=None if plan.mode is Mode.LOSSLESS else plan.threshold,
        verify=plan.mode is not Mode.THRESHOLD,
    )
    return make_plan(mars, **{**request, **asked})
