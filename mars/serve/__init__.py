"""`mars serve`: an OpenAI-compatible server whose speed knob (the threshold) turns with load.

    policy.py   which threshold each row decodes at: fixed, or adaptive to load
    engine.py   the model's thread: continuous batching on the block-level cache
    api.py      request validation, response shapes, streamed text with stop strings
    app.py      the ASGI app (starlette); uvicorn runs it

Needs the `serve` extra (starlette, uvicorn); mars.core stays free of it.
"""

from __future__ import annotations

from ..core.decode.plan import Mode
from ..core.decode.rules import checkpoint_mode, metric_for
from .api import ServeLimits
from .engine import Engine, EngineLimits
from .policy import PolicySettings, ThresholdPolicy


def build(
    session,
    *,
    name: str = "default",
    aliases=(),
    block_size: int | None = None,
    policy: dict | None = None,
    engine_limits: EngineLimits | None = None,
    serve_limits: ServeLimits | None = None,
    admin_from_anywhere: bool = False,
):
    """(app, engine) serving a model opened for decoding (mars.session.Session; its decoders,
    one per batch, from `session.new_decoder`), under `name` and `aliases`.

    `policy` holds PolicySettings fields; unset ones default from the checkpoint: the default
    mode is its mars.json default_mode (but "threshold" when a default threshold or the
    adaptive policy is given), the fixed threshold is its mars.json default_threshold (else
    AR mode), the adaptive range runs from AR mode to the metric's default loose end, and
    full load is the batch size. The session's `remeasure_cost` says whether its cost curves
    are measured again rather than read from the kept ones."""
    from .app import create_app

    metric = metric_for(session.mars)
    engine_limits = engine_limits or EngineLimits()
    given = dict(policy or {})
    # The checkpoint's default mode, unless the server is given a threshold or a policy that turns it.
    threshold, lossless = checkpoint_mode(session.mars, metric, given.get("default_threshold"))
    if given.get("default_mode") is None:
        fixed = given.get("policy", "fixed") == "fixed"
        given["default_mode"] = (Mode.LOSSLESS if lossless and fixed else Mode.THRESHOLD).value
    given["default_threshold"] = threshold
    if given.get("full_load") is None:
        given["full_load"] = engine_limits.max_batch
    threshold_policy = ThresholdPolicy(metric, PolicySettings.for_metric(metric, **given), trained=session.trained)
    engine = Engine(session, threshold_policy, engine_limits, name=name, aliases=aliases, block_size=block_size)
    return create_app(engine, serve_limits, admin_from_anywhere=admin_from_anywhere), engine


__all__ = ["Engine", "EngineLimits", "PolicySettings", "ServeLimits", "ThresholdPolicy", "build"]
