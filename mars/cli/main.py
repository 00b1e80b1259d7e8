"""The `mars` command: thin click wrappers that parse, call the library, and print.

Each subcommand lives in its own module; the pieces they share are in common.py."""

from __future__ import annotations

import click

from .. import __version__
from .bench import bench_command
from .convert import convert_command
from .corpus import corpus_command
from .distill import distill_command
from .evaluate import evaluate_command
from .finetune import finetune_command
from .generate import chat_command, generate_command
from .interrupt import InterruptibleGroup
from .serve import serve_command


@click.group(cls=InterruptibleGroup)
@click.version_option(__version__, prog_name="mars")
def cli():
    """MARS: fine-tune a causal LM to emit several tokens per forward pass, and decode it with a speed knob."""


for command in (
    finetune_command,
    generate_command,
    chat_command,
    convert_command,
    evaluate_command,
    bench_command,
    distill_command,
    corpus_command,
    serve_command,
):
    cli.add_command(command)


def main():
    cli()


if __name__ == "__main__":
    main()
