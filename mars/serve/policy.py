"""Which threshold each row decodes at: fixed, or turned by load (docs/method.md §8).

The threshold's direction follows the metric (docs/method.md §5): the strict end is AR mode's side
(high tau for probability and margin, low for entropy), the loose end the other. With
`--min-threshold 0.7 --max-threshold 1.0` and the probability metric, the adaptive policy
decodes at 1.0 (plain greedy AR) when one request is in flight and at 0.7 when the load
(queued requests + rows in flight) reaches `full_load`; with the entropy metric the same
range runs from 0.7 at low load to 1.0 at full load.

Per request:
- `lossless: true` has no threshold; no policy touches it.
- fixed policy: the request's `threshold`, else the server default: losslessly when
  `default_mode` is "lossless" (by default, when the checkpoint's mars.json says so), else
  at `default_threshold`.
- adaptive policy: the request's `threshold`, when given, bounds its strictness: the row
  decodes at the looser of it and the threshold in force (so a request may ask for more
  speed than the load grants, never for less). `"adaptive": false` in the request pins it
  to its own threshold (else the server default).

A model without mars.json was never trained to fill masks: only AR mode (or lossless decoding)
is allowed (mars.core.decode.rules).
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, replace

from ..core.acceptance import ThresholdError, ar_threshold, check_metric, check_threshold, looser, strict_and_loose
from ..core.decode.plan import Mode
from ..core.decode.rules import UntrainedModelError, check_may_decode, may_decode

POLICIES = ("fixed", "adaptive")
LEVELS = 5  # the adaptive threshold moves between this many evenly spaced values
# The loose end of the adaptive range when none is given, per metric.
DEFAULT_LOOSE = {"probability": 0.7, "margin": 0.5, "entropy": 1.0}


class PolicyError(ValueError):
    """A policy setting that cannot be used; the message names the setting."""


# What --default-mode may name: the modes a request without a threshold can default to.
DEFAULT_MODES = (Mode.THRESHOLD.value, Mode.LOSSLESS.value)


@dataclass
class PolicySettings:
    policy: str = "fixed"
    default_threshold: float = 1.0  # requests without a threshold, under the fixed policy
    min_threshold: float = 0.7  # the adaptive range, in tau's own units
    max_threshold: float = 1.0
    full_load: int = 16  # load (queued + in flight) at which the adaptive threshold is loosest
    hold: float = 2.0  # seconds the load must stay lower before the threshold tightens
    # How a request that names neither a threshold nor lossless decodes under the fixed policy:
    # at default_threshold, or losslessly (a checkpoint's mars.json default_mode decides by default).
    # The adaptive policy always turns the threshold.
    default_mode: str = "threshold"

    @classmethod
    def for_metric(cls, metric: str, **given) -> "PolicySettings":
        """Defaults for a metric: the range from AR mode to DEFAULT_LOOSE; None means default."""
        given = {k: v for k, v in given.items() if v is not None}
        ends = sorted([ar_threshold(metric), DEFAULT_LOOSE[check_metric(metric)]])
        base = cls(default_threshold=ar_threshold(metric), min_threshold=ends[0], max_threshold=ends[1])
        return replace(base, **given)


class ThresholdPolicy:
    """The threshold in force (thread-safe: the engine reads it, the admin endpoint sets it)."""

    def __init__(self, metric: str, settings: PolicySettings, *, trained: bool = True):
        self.metric = check_metric(metric)
        self.trained = trained
        self._lock = threading.Lock()
        self._check(settings)
        self.settings = settings
        self._level = 0  # 0: the strict end
        self._lower_since: float | None = None  # when the load fell below the current level
        self._lower_peak = 0  # the highest level the load asked for since then

    # -- configuration ------------------------------------------------------------------------

    def configure(self, **changes) -> dict:
        """Change settings live (None leaves one as it is); returns the new description."""
        unknown = sorted(set(changes) - set(asdict(self.settings)))
        if unknown:
            raise PolicyError(
                f"unknown policy setting '{unknown[0]}' (known: {', '.join(sorted(asdict(self.settings)))})"
            )
        with self._lock:
            new = replace(self.settings, **{k: v for k, v in changes.items() if v is not None})
            self._check(new)
            self.settings = new
            self._level = min(self._level, LEVELS - 1)
            self._lower_since = None
        return self.describe()

    def _check(self, s: PolicySettings) -> None:
        if s.policy not in POLICIES:
            raise PolicyError(f"policy must be one of {', '.join(POLICIES)}, got {s.policy!r}")
        if s.default_mode not in DEFAULT_MODES:
            raise PolicyError(f"default_mode must be one of {', '.join(DEFAULT_MODES)}, got {s.default_mode!r}")
        for name in ("default_threshold", "min_threshold", "max_threshold"):
            try:
                check_threshold(self.metric, getattr(s, name), name=name)
            except ThresholdError as e:
                raise PolicyError(str(e)) from None
        if isinstance(s.hold, bool) or not isinstance(s.hold, (int, float)) or not math.isfinite(s.hold):
            raise PolicyError(f"hold must be a finite number, got {s.hold!r}")
        if s.min_threshold > s.max_threshold:
            raise PolicyError(f"min_threshold {s.min_threshold} is above max_threshold {s.max_threshold}")
        if s.hold < 0:
            raise PolicyError(f"hold must be >= 0 seconds, got {s.hold}")
        if isinstance(s.full_load, bool) or not isinstance(s.full_load, int) or s.full_load < 1:
            raise PolicyError(f"full_load must be an integer >= 1, got {s.full_load!r}")
        if not self.trained and s.policy == "adaptive":
            raise PolicyError(
                "the adaptive policy needs a MARS-trained model (this one has no mars.json); use the fixed policy"
            )
        try:
            check_may_decode(self.trained, self.metric, s.default_threshold)
        except UntrainedModelError as e:
            raise PolicyError(f"default_threshold {s.default_threshold}: {e}") from None

    def describe(self) -> dict:
        with self._lock:
            return {**asdict(self.settings), "metric": self.metric, "threshold": self._in_force()}

    # -- the threshold ------------------------------------------------------------------------

    def _in_force(self) -> float:
        if self.settings.policy == "fixed":
            return float(self.settings.default_threshold)
        strict, loose = strict_and_loose(self.metric, self.settings.min_threshold, self.settings.max_threshold)
        return round(strict + (loose - strict) * self._level / (LEVELS - 1), 6)

    @property
    def threshold(self) -> float:
        """The threshold in force: the default under the fixed policy, the load's under adaptive."""
        with self._lock:
            return self._in_force()

    def update(self, load: int, now: float) -> float:
        """Feed the current load (queued + in flight); returns the threshold in force.

        Hysteresis: a higher load loosens at once (a queue is growing: act now); a lower load
        tightens only once it has stayed lower for `hold` seconds, and then only to the
        loosest level asked for in that time, so bursty arrivals do not flap the threshold."""
        with self._lock:
            s = self.settings
            if s.policy == "fixed":
                return self._in_force()
            span = max(s.full_load - 1, 1)
            fraction = min(max(load - 1, 0) / span, 1.0)
            target = math.floor(fraction * (LEVELS - 1) + 0.5)
            if target >= self._level:
                self._level = target
                self._lower_since = None
            elif self._lower_since is None:
                self._lower_since, self._lower_peak = now, target
            else:
                self._lower_peak = max(self._lower_peak, target)
                if now - self._lower_since >= s.hold:
                    self._level = self._lower_peak
                    self._lower_since = None
            return self._in_force()

    def for_request(self, requested: float | None, *, pinned: bool = False) -> float:
        """The threshold a (non-lossless) row decodes at now."""
        with self._lock:
            s = self.settings
            if s.policy == "fixed" or pinned:
                return float(s.default_threshold if requested is None else requested)
            in_force = self._in_force()
            if requested is None:
                return in_force
            return looser(self.metric, requested, in_force)

    @property
    def default_mode(self) -> Mode:
        """How a request that names neither a threshold nor lossless is planned: losslessly
        (fixed policy, default_mode "lossless") or at the threshold in force."""
        with self._lock:
            lossless = self.settings.policy == "fixed" and self.settings.default_mode == Mode.LOSSLESS.value
        return Mode.LOSSLESS if lossless else Mode.THRESHOLD

    def allowed(self, requested: float) -> bool:
        """A request may ask for any threshold on a MARS model, only AR mode on another."""
        return may_decode(self.trained, self.metric, requested)

    def check(self, requested: float) -> None:
        """Raise UntrainedModelError where `allowed` says no."""
        check_may_decode(self.trained, self.metric, requested)
