"""What a model decodes at when nothing is asked, and what it may decode at (docs/method.md §5, §7):
the rules mars.core.decode.plan.make_plan applies for every entry point. A model without mars.json
was never trained to fill masks and its guesses are confidently wrong, so it decodes only in AR
mode or losslessly unless forced. The threshold rules themselves live in mars.core.acceptance."""

from __future__ import annotations

from collections.abc import Callable

from ..acceptance import ar_threshold, check_metric, is_ar_mode
from ..config import MarsConfig

# What a model without mars.json decodes with: a checkpoint's defaults (MarsConfig's fields).
DEFAULT_BLOCK_SIZE: int = MarsConfig.block_size
DEFAULT_METRIC: str = MarsConfig.metric
# The most n-gram drafts a step of the default lossless configuration feeds (mars.core.decode.drafts.ngram; a
# cost-aware feed cuts them to what pays: 32 gave a flat curve more, this CPU's the same).
DEFAULT_NGRAM = 32
# The most runners-up of a first draft a default lossless step may feed as alternative groups.
DEFAULT_ALTERNATIVES = 2


class UntrainedModelError(ValueError):
    """Decoding below AR mode asked of a model without mars.json; one line, naming no option."""


def metric_for(mars: MarsConfig | None, metric: str | None = None) -> str:
    """The confidence metric: the one asked for, else the checkpoint's, else the default."""
    return check_metric(metric or (mars.metric if mars is not None else DEFAULT_METRIC))


def block_size_for(mars: MarsConfig | None, block_size: int | None = None) -> int:
    """Masks per step: the number asked for, else the checkpoint's, else the default."""
    return block_size or (mars.block_size if mars is not None else DEFAULT_BLOCK_SIZE)


def checkpoint_mode(
    mars: MarsConfig | None, metric: str, threshold: float | None = None, lossless: bool = False
) -> tuple[float, bool]:
    """(threshold, lossless) of a run: the threshold asked for, else the checkpoint's default mode
    (mars.json's default_threshold and default_mode); a model without mars.json, AR mode."""
    if threshold is not None:
        return threshold, lossless
    if mars is None:
        return ar_threshold(metric), lossless
    return mars.default_threshold, lossless or mars.lossless_by_default


def may_decode(trained: bool, metric: str, threshold: float, *, lossless: bool = False) -> bool:
    """Whether a model may decode at `threshold`: a MARS-trained one (with mars.json) always; any
    model in AR mode or losslessly (the output is then AR's whatever the masks guess)."""
    return trained or lossless or is_ar_mode(metric, threshold)


def untrained_message(metric: str) -> str:
    return (
        "this model has no mars.json (never MARS-trained), so its mask guesses are confidently wrong: "
        f"it decodes only at threshold {ar_threshold(metric)} (plain AR) or losslessly"
    )


def check_may_decode(
    trained: bool,
    metric: str,
    threshold: float,
    *,
    lossless: bool = False,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
) -> None:
    """Raise UntrainedModelError where `may_decode` says no, unless `force`; forced, `warn`
    (when given) hears what to expect."""
    if may_decode(trained, metric, threshold, lossless=lossless):
        return
    if not force:
        raise UntrainedModelError(untrained_message(metric))
    if warn is not None:
        warn(f"decoding a model without MARS training below threshold {ar_threshold(metric)}: expect wrong tokens")
