"""`mars eval`: NLL against a baseline and a decoding threshold sweep (see mars/evaluate.py)."""

from __future__ import annotations

from pathlib import Path

import click

from ..evaluate import DEFAULT_THRESHOLDS, EvalSettings
from .common import (
    CACHE_CHOICE,
    METRIC_CHOICE,
    backend_option,
    compile_option,
    defaults,
    device_options,
    friendly_errors,
    quiet_libraries,
    say,
)

E = defaults(EvalSettings)


def _parts(value) -> list[str]:
    """A repeated, comma-separated option's values, as strings."""
    return [p.strip() for p in ",".join(value).split(",") if p.strip()]


def _thresholds(ctx, param, value):
    if not value:
        return None
    out = []
    for part in _parts(value):
        try:
            out.append(float(part))
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a number", param=param) from None
    return tuple(out)


def _trees(ctx, param, value):
    for part in _parts(value):
        if not part.isdigit():
            raise click.BadParameter(f"{part!r} is not a whole number >= 0", param=param)
    return tuple(int(p) for p in _parts(value)) or (0,)


def _hedges(ctx, param, value):
    for part in _parts(value):
        if not part.isdigit():
            raise click.BadParameter(f"{part!r} is not a whole number >= 0", param=param)
    return tuple(int(p) for p in _parts(value)) or (None,)


@click.command("eval")
@click.option(
    "--model",
    "models",
    multiple=True,
    help="A model to evaluate (repeat for several: one line each in the plot). Default: the embedded "
    "SmolLM2-135M-Instruct.",
)
@click.option(
    "--baseline", default=None, help="A model whose NLL the others are compared with (e.g. the plain SFT model)."
)
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    help="A data directory (test.jsonl, else valid.jsonl) or one .jsonl file.",
)
@click.option("--split", default=None, help="The split of --data to use (default: test, falling back to valid).")
@click.option(
    "--prompts",
    "prompt_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help='Decode these prompts instead of the dataset\'s: JSONL ({"prompt"}, {"messages"} or {"text"}, the last '
    "continued without the chat template) or one per line.",
)
@click.option(
    "--threshold",
    "thresholds",
    multiple=True,
    callback=_thresholds,
    help=f"Thresholds to sweep (repeat, or comma-separated). Default: {','.join(map(str, DEFAULT_THRESHOLDS))}.",
)
@click.option("--metric", type=METRIC_CHOICE, default=None, help="Confidence metric (default: the checkpoint's).")
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=None,
    help="Masks per step (default: each checkpoint's block size).",
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=E["max_tokens"], show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=E["batch_size"], show_default=True)
@click.option("--cache", type=CACHE_CHOICE, default=E["cache"], show_default=True)
@click.option(
    "--block-cache",
    type=click.IntRange(min=1),
    default=E["block_cache"],
    show_default=True,
    help="B_cache of --cache block.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Decode at most N prompts.")
@click.option("--max-seq-length", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--on-long", type=click.Choice(["error", "truncate", "skip"]), default=E["on_long"], show_default=True)
@click.option("--no-nll", is_flag=True, help="Skip the NLL measurement.")
@click.option("--no-decode", is_flag=True, help="Skip the threshold sweep.")
@click.option("--force", is_flag=True, help="Sweep thresholds below 1 on models without mars.json too.")
@click.option(
    "--lossless",
    is_flag=True,
    help="Also decode in lossless mode (the masks draft, the next forward verifies), and report its parity "
    "with AR in the format the model ran in (see above).",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Also decode each threshold below 1.0 in verified threshold mode (rows vX): proposals not taken are "
    "verified by the next step; parity reported as for --lossless.",
)
@click.option(
    "--hedge",
    "hedges",
    multiple=True,
    callback=_hedges,
    help="Lossless rows: spare mask groups per step (repeat, or comma-separated, for one row each). Default: the block "
    "size.",
)
@click.option(
    "--tree",
    "trees",
    multiple=True,
    callback=_trees,
    help="Lossless rows: also feed up to N tree nodes a step, the masks' runners-up off the chain of drafts "
    "(repeat, or comma-separated, for one row each; rows /tN). Default: 0, the chain alone.",
)
@click.option(
    "--alternatives",
    type=click.IntRange(min=0),
    default=E["alternatives"],
    show_default=True,
    help="Lossless and verified rows: also feed up to N runners-up of the first draft as alternative groups (rows "
    "/aN).",
)
@click.option(
    "--ngram",
    type=click.IntRange(min=0),
    default=E["ngram"],
    show_default=True,
    help="Lossless and verified rows: also draft up to N tokens a step from n-gram lookup in the prompt and reply "
    "and from the checkpoint's draft corpus (rows /nN, /nNc with the corpus), as `mars generate` does; "
    "0: the masks' drafts only, the weights' own figure.",
)
@click.option(
    "--humaneval",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Also decode the first N HumanEval problems in every mode and report pass@1 (needs pip install "
    "'mars-mtp[eval]'); "
    "each reply's code runs in its own Python process with a timeout.",
)
@click.option(
    "--output", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the report as JSON here."
)
@click.option("--outputs", "with_outputs", is_flag=True, help="Include the decoded token ids in the JSON.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a PNG: tokens/forward against agreement with AR.",
)
@click.option(
    "--plot-x",
    type=click.Choice(["exact", "prefix"]),
    default="exact",
    show_default=True,
    help="The plot's x axis: exact-match rate or mean prefix fraction.",
)
@device_options
@compile_option
@backend_option
@friendly_errors
def evaluate_command(
    models,
    baseline,
    data,
    split,
    prompt_file,
    thresholds,
    metric,
    block_size,
    max_tokens,
    batch_size,
    cache,
    block_cache,
    limit,
    max_seq_length,
    on_long,
    no_nll,
    no_decode,
    force,
    lossless,
    verify,
    hedges,
    trees,
    alternatives,
    ngram,
    humaneval,
    output,
    with_outputs,
    plot_path,
    plot_x,
    dtype,
    device,
    compile_steps,
    backend,
):
    """Evaluate checkpoints: NLL per response token (vs --baseline) and a decoding threshold sweep.

    \b
    Parity (lossless and verified rows): the replies identical to AR's in the same run and
    format (dtype and backend, e.g. torch bfloat16, mlx 4-bit) and, for each other reply, its
    first divergence: prompt, position, AR's token and the row's, and AR's top-2 logit gap
    there (largest minus second-largest logit, from a plain forward of the prompt and AR's
    reply up to that position). Lossless replies equal AR's in float32; in bfloat16, float16
    or quantized weights a multi-token forward may round differently from a one-token forward.
    A gap within a few units in the last place of the format at the logits' magnitude is a
    near-tie that rounding decides, not an error of the method.
    """
    from .. import evaluate as ev
    from ..core.train.data import read_jsonl
    from ..prompts import read_prompts

    if data is None and prompt_file is None and not humaneval:
        raise click.UsageError("give --data (a dataset), --prompts FILE or --humaneval N")
    if no_nll and no_decode and not humaneval:
        raise click.UsageError(
            "--no-nll and --no-decode leave nothing to do (add --humaneval N to decode HumanEval alone)"
        )
    if prompt_file is not None and not prompt_file.is_file():
        raise click.ClickException(f"{prompt_file}: no such file")
    if data is not None:
        # A missing or malformed dataset fails before any model loads.
        path, _ = ev.eval_file(data, split)
        prompts = ev.dataset_prompts(path)
        if not prompts and prompt_file is None and not no_decode:
            raise click.ClickException(
                f'{path}: no prompts to decode ({{"text"}} records have none); pass --prompts FILE or --no-decode'
            )
        texts = sum(1 for _ in read_jsonl(path)) - len(prompts)
        if texts and prompt_file is None and not no_decode:
            say(
                f'note: {path}: {texts} {{"text"}} record{"s" * (texts > 1)} without a prompt: in the NLL, not in the '
                f"decoding "
                "sweep (pass them with --prompts to decode them as raw text)"
            )
    if data is None and baseline is not None:
        raise click.UsageError("--baseline compares NLL, which needs --data")
    prompts = read_prompts(prompt_file, text=True) if prompt_file else None
    settings = ev.EvalSettings(
        thresholds=thresholds or ev.DEFAULT_THRESHOLDS,
        metric=metric,
        block_size=block_size,
        max_tokens=max_tokens,
        batch_size=batch_size,
        cache=cache,
        block_cache=block_cache,
        max_seq_length=max_seq_length,
        on_long=on_long,
        limit=limit,
        force=force,
        decode=not no_decode,
        nll=not no_nll,
        lossless=lossless,
        verify=verify,
        hedges=hedges,
        trees=trees,
        alternatives=alternatives,
        ngram=ngram,
        humaneval=humaneval,
    )
    if humaneval:
        from ..humaneval import HumanEvalUnavailable, load_problems

        try:
            load_problems(1)  # fails before any model loads
        except HumanEvalUnavailable as e:
            raise click.ClickException(str(e)) from None
    quiet_libraries()

    def load(m):
        return ev.load_model(m, backend, dtype=dtype, device=device, announce=say, compile=compile_steps)

    sessions = [load(m) for m in (models or [None])]
    base = load(baseline) if baseline is not None else None
    report = ev.evaluate(
        sessions, baseline=base, data=data, split=split, prompts=prompts, settings=settings, announce=say
    )
    click.echo(ev.format_table(report))
    if output is not None:
        click.echo(f"wrote {ev.write_json(report, output, outputs=with_outputs)}", err=True)
    if plot_path is not None:
        if not settings.decode:
            raise click.UsageError("--plot needs the threshold sweep (drop --no-decode)")
        try:
            click.echo(f"wrote {ev.plot(report, plot_path, x=plot_x)}", err=True)
        except ImportError as e:
            raise click.ClickException(str(e)) from None
