"""Ctrl-C: exit status 130 (128 + SIGINT, as shells report it) and one line saying what was
kept and how to go on, instead of click's "Aborted!" and status 1."""

from __future__ import annotations

import shlex
import sys

import click
from tqdm import tqdm

EXIT_INTERRUPTED = 130
ARGS_KEY = "mars.args"  # where the group keeps the arguments it was given


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C that a command has explained: its message is the line to print."""


def rerun_command(*, adding: str | None = None) -> str:
    """The command as it was given (`mars` and its arguments), with the flag `adding` appended
    unless it is there already: the exact line to run to go on."""
    args = list(click.get_current_context().meta.get(ARGS_KEY, sys.argv[1:]))
    if adding and adding not in args:
        args.append(adding)
    return shlex.join(["mars", *args])


class InterruptibleGroup(click.Group):
    """A group that keeps its arguments (for `rerun_command`) and turns Ctrl-C into exit 130."""

    def parse_args(self, ctx, args):
        ctx.meta[ARGS_KEY] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            _close_progress_bars()
            click.echo("", err=True)  # off a progress bar's line
            click.echo(str(e) if isinstance(e, Interrupted) and str(e) else "interrupted", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


def _close_progress_bars() -> None:
    """Close the bars the interrupted work left open: collected later, they would print
    themselves again under the line."""

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
