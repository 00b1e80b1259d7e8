"""`mars corpus`: a draft corpus (the model's own replies) for lossless decoding's corpus drafts."""

from __future__ import annotations

from pathlib import Path

import click

from .common import friendly_errors, say


@click.command("corpus")
@click.option(
    "--data",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="The replies to draft from: a .jsonl file, or a data directory's train.jsonl (e.g. `mars distill` output; "
    "never test data).",
)
@click.option(
    "--model",
    default=None,
    help="The model (HF directory, .gguf, adapter directory) whose tokenizer encodes the data [default: the embedded "
    "default].",
)
@click.option(
    "--output",
    required=True,
    type=click.Path(path_type=Path),
    help="A checkpoint directory (writes its draft_corpus.npz: decoding it then drafts from the corpus) or an .npz "
    "file.",
)
@friendly_errors
def corpus_command(data, model, output):
    """Build a draft corpus: lossless decoding (with --ngram > 0) also drafts what these replies
    say comes next, verified like every draft, so the output stays AR's."""
    from ..checkpoint.paths import load_tokenizer, resolve_model_path, tokenizer_path
    from ..core.decode.drafts.corpus import FILE, CorpusError, from_data

    if output.suffix != ".npz":
        if not output.is_dir():
            raise CorpusError(f"{output}: not a directory; pass a checkpoint directory or a path ending in .npz")
        output = output / FILE
    corpus = from_data(data, load_tokenizer(tokenizer_path(*resolve_model_path(model))), announce=say)
    corpus.save(output)
    click.echo(f"{len(corpus)} tokens -> {output}")
