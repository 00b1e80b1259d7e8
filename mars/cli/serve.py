"""`mars serve`: the OpenAI-compatible server (the serving itself lives in mars.serve)."""

from __future__ import annotations

from pathlib import Path

import click

from ..serve.policy import DEFAULT_MODES
from .common import Finite, backend_option, compile_option, defaults, device_options, friendly_errors, open_session


def _serve_defaults() -> dict:
    """The server's settings dataclasses' defaults (mars.serve imports no web framework)."""
    from ..serve import EngineLimits, PolicySettings, ServeLimits

    return {**defaults(EngineLimits), **defaults(ServeLimits), **defaults(PolicySettings)}


S = _serve_defaults()


@click.command("serve")
@click.option(
    "--model",
    default=None,
    help="HF model directory, .gguf file or MARS adapter directory. Default: the embedded SmolLM2-135M-Instruct with "
    "its MARS weights.",
)
@click.option(
    "--adapter-path",
    type=click.Path(path_type=Path),
    default=None,
    help="A LoRA adapter directory written by `mars finetune`.",
)
@click.option(
    "--served-model-name", default=None, help="The model id clients ask for (default: --model as given, or 'default')."
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--policy",
    type=click.Choice(["fixed", "adaptive"]),
    default="fixed",
    show_default=True,
    help="fixed: each request's threshold, else --threshold; adaptive: the threshold loosens as load rises.",
)
@click.option(
    "--threshold",
    type=float,
    default=None,
    help="Threshold for requests that give none (fixed policy). Default: the checkpoint's, else 1.0.",
)
@click.option(
    "--default-mode",
    type=click.Choice(DEFAULT_MODES),
    default=None,
    help="How requests that give neither threshold nor lossless decode (fixed policy). "
    "Default: the checkpoint's mars.json default_mode, unless --threshold is given.",
)
@click.option(
    "--min-threshold",
    type=float,
    default=None,
    help="Adaptive range, low end (default: 0.7 for probability, 0.5 margin, 0.0 entropy).",
)
@click.option(
    "--max-threshold", type=float, default=None, help="Adaptive range, high end (default: 1.0; entropy: 1.0)."
)
@click.option(
    "--full-load",
    type=click.IntRange(min=1),
    default=None,
    help="Adaptive: the load (queued + in flight) that reaches the loose end. Default: --max-batch.",
)
@click.option(
    "--hold",
    type=Finite(min=0.0),
    default=S["hold"],
    show_default=True,
    help="Adaptive: seconds the load must stay lower before the threshold tightens again.",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=None,
    help="Masks per step (default: the checkpoint's block size).",
)
@click.option(
    "--block-cache",
    type=click.IntRange(min=1),
    default=S["block_cache"],
    show_default=True,
    help="B_cache: slots per block of the block cache (--cache block).",
)
@click.option(
    "--cache",
    type=click.Choice(["window", "block"]),
    default=S["cache"],
    show_default=True,
    help="The cache requests decode on: window (they join at once; greedy lossless ones draft from the masks and "
    "n-gram lookup, the feed chosen per step from the device's cost curves) or block (the block-level cache, "
    "--block-cache slots; requests join at block boundaries).",
)
@click.option(
    "--ngram",
    type=click.IntRange(min=0),
    default=S["ngram"],
    show_default=True,
    help="Greedy lossless requests on the window cache: the most n-gram lookup drafts a step may feed (0: off).",
)
@click.option(
    "--alternatives",
    type=click.IntRange(min=0),
    default=S["alternatives"],
    show_default=True,
    help="Greedy lossless requests on the window cache: the most runner-up groups of the first draft a step may feed "
    "(0: off).",
)
@click.option(
    "--tree",
    type=click.IntRange(min=0),
    default=S["tree"],
    show_default=True,
    help="Lossless requests (greedy or sampled): the most tree nodes (the masks' runners-up off the chain of "
    "drafts) a step may feed (0: off).",
)
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    default=S["max_batch"],
    show_default=True,
    help="Requests decoded together.",
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=0),
    default=S["max_queue"],
    show_default=True,
    help="Requests waiting for a row; past it: 429 with Retry-After.",
)
@click.option(
    "--max-prompt-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Longest prompt accepted (default: the model's context length).",
)
@click.option(
    "--max-tokens-limit",
    type=click.IntRange(min=1),
    default=S["max_tokens_limit"],
    show_default=True,
    help="The most max_tokens a request may ask for.",
)
@click.option(
    "--default-max-tokens",
    type=click.IntRange(min=1),
    default=S["default_max_tokens"],
    show_default=True,
    help="max_tokens for a request that gives none.",
)
@click.option(
    "--temp",
    type=Finite(0.0, 2.0),
    default=S["temperature"],
    show_default=True,
    help="Temperature for a request that gives none (0: greedy).",
)
@click.option(
    "--admin-from-anywhere", is_flag=True, help="Let non-loopback clients use /admin/* (default: loopback only)."
)
@click.option(
    "--remeasure-cost",
    is_flag=True,
    help="Measure again what a forward costs on this device (the curves the feed is chosen "
    "from, measured once and kept under the cache directory).",
)
@compile_option
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
@device_options
@backend_option
@friendly_errors
def serve_command(
    model,
    adapter_path,
    served_model_name,
    host,
    port,
    policy,
    threshold,
    default_mode,
    min_threshold,
    max_threshold,
    full_load,
    hold,
    block_size,
    block_cache,
    cache,
    ngram,
    alternatives,
    tree,
    max_batch,
    max_queue,
    max_prompt_tokens,
    max_tokens_limit,
    default_max_tokens,
    temp,
    admin_from_anywhere,
    remeasure_cost,
    compile_steps,
    log_level,
    dtype,
    device,
    backend,
):
    """Serve a model with an OpenAI-compatible API (chat and text completions, streaming).

    Requests decode in the checkpoint's default mode (mars.json default_mode) unless --threshold
    or --default-mode says otherwise. Requests may add "threshold" (the speed knob), "lossless": true (output exactly
    AR's),
    "verify": false (plain threshold mode; greedy threshold requests are verified by default, as in mars generate)
    and, under --policy adaptive, "adaptive": false (keep the request's own threshold). usage.mode names the mode a
    reply ran in, as mars generate --json does.
    GET /metrics for Prometheus; POST /admin/policy changes the policy live (loopback only).
    """
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise click.ClickException("mars serve needs starlette and uvicorn: pip install 'mars-mtp[serve]'") from None
    from ..core.acceptance import check_threshold
    from ..core.decode.rules import metric_for
    from ..serve import EngineLimits, ServeLimits, build
    from ..serve.policy import PolicyError

    session = open_session(
        model, adapter_path, dtype, device, backend, remeasure_cost=remeasure_cost, compile=compile_steps
    )
    metric = metric_for(session.mars)
    for flag, value in (
        ("--threshold", threshold),
        ("--min-threshold", min_threshold),
        ("--max-threshold", max_threshold),
    ):
        if value is not None:
            check_threshold(metric, value, name=flag)
    if default_mode == "lossless" and policy == "adaptive":
        raise click.BadParameter(
            "lossless requests have no threshold for the adaptive policy to turn; use --policy fixed",
            param_hint="--default-mode",
        )
    name = served_model_name or (model if model is not None else "default")
    aliases = {Path(model).name} if model is not None else {"SmolLM2-135M-Instruct"}
    if served_model_name and model is not None:
        aliases.add(model)
    try:
        app, engine = build(
            session,
            name=name,
            aliases=tuple(sorted(aliases)),
            block_size=block_size,
            policy=dict(
                policy=policy,
                default_mode=default_mode,
                default_threshold=threshold,
                min_threshold=min_threshold,
                max_threshold=max_threshold,
                full_load=full_load,
                hold=hold,
            ),
            engine_limits=EngineLimits(
                max_batch=max_batch,
                max_queue=max_queue,
                block_cache=block_cache,
                cache=cache,
                ngram=ngram,
                alternatives=alternatives,
                tree=tree,
            ),
            serve_limits=ServeLimits(
                max_prompt_tokens=max_prompt_tokens,
                max_tokens_limit=max_tokens_limit,
                default_max_tokens=min(default_max_tokens, max_tokens_limit),
                temperature=temp,
            ),
            admin_from_anywhere=admin_from_anywhere,
        )
    except PolicyError as e:
        raise click.ClickException(str(e)) from None
    described = engine.policy.describe()
    knob = (
        f"adaptive threshold {described['max_threshold']}..{described['min_threshold']} ({described['metric']}), "
        f"full at load {described['full_load']}"
        if described["policy"] == "adaptive"
        else f"lossless by default (threshold {described['default_threshold']} ({described['metric']}) on request)"
        if engine.policy.default_mode.value == "lossless"
        else f"fixed threshold {described['default_threshold']} ({described['metric']}; greedy requests verified "
        f"unless they say "
        f'"verify": false)'
    )
    engine.prepare_feed(announce=lambda m: click.echo(m, err=True))
    untrained = "" if session.trained else " (no mars.json: plain AR at threshold 1.0, or lossless, only)"
    click.echo(
        f"serving '{name}' on http://{host}:{port}/v1: {knob}, B={engine.block_size}, "
        f"{cache} cache{f' (B_cache={block_cache})' if cache == 'block' else ''}, batch {max_batch}, queue "
        f"{max_queue}{untrained}",
        err=True,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)
