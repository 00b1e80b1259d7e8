"""`mars distill`: prompts in, the model's own greedy replies out, as a training set."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..distill import DistillSettings
from .common import backend_option, defaults, friendly_errors, model_options, open_session, say
from .interrupt import Interrupted, rerun_command

D = defaults(DistillSettings)


@click.command("distill")
@model_options
@click.option(
    "--prompts",
    "prompts",
    required=True,
    type=click.Path(path_type=Path),
    help='A .jsonl prompt file, or a directory of train/valid/test .jsonl ({"messages"} or {"prompt"}, optional '
    '"follow_ups").',
)
@click.option(
    "--output",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The data directory to write (mlx-lm chat JSONL).",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=D["max_tokens"],
    show_default=True,
    help='Reply length cap; cut replies are marked "finish": "length".',
)
@click.option("--batch-size", type=click.IntRange(min=1), default=D["batch_size"], show_default=True)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help="At most this many prompts per split; rerun with a larger one to extend a finished output.",
)
@backend_option
@friendly_errors
def distill_command(model, adapter_path, dtype, device, prompts, output, max_tokens, batch_size, limit, backend):
    """Self-distil: answer every prompt with the model's greedy (threshold 1.0) reply.

    Resumable: rerun the same command after an interruption and it continues.
    """
    from ..checkpoint.default_model import model_ref
    from ..checkpoint.paths import resolve_model_path
    from ..distill import distill, prompt_files, read_prompt_file

    for _, path in prompt_files(prompts):  # bad prompts fail before the model loads
        read_prompt_file(path)
    session = open_session(model, adapter_path, dtype, device, backend)
    base, adapter = resolve_model_path(model, adapter_path)
    ref = model_ref(base) + (f" + {adapter.resolve()}" if adapter is not None else "")
    settings = DistillSettings(max_tokens=max_tokens, batch_size=batch_size, limit=limit)
    try:
        summary = distill(session.loaded, session.decoder, prompts, output, settings, model_ref=ref, log=say)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted; the replies written so far are kept in {output}; continue with: {rerun_command()}"
        ) from None
    click.echo(json.dumps(summary["splits"]))
    click.echo(f"{summary['generated_tokens']} tokens in {summary['seconds']}s -> {output}")
