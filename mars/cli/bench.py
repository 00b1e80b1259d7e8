"""`mars bench`: decoding speed side by side (the timing lives in mars.bench)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..bench import BenchSettings
from .common import (
    METRIC_CHOICE,
    backend_option,
    compile_option,
    defaults,
    error_line,
    friendly_errors,
    model_path_options,
    quiet_libraries,
    say,
)

B = defaults(BenchSettings)


def int_ranges(text: str, option: str) -> tuple[int, ...]:
    """`1,4,8` or `1-32` (or a mix) -> (1, 4, 8)."""
    out = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise click.BadParameter(f"expected numbers like 1,4,8 or 1-32, got {text!r}", param_hint=option) from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"every value must be >= 1, got {text!r}", param_hint=option)
    return tuple(out)


@click.command("bench")
@model_path_options
@click.option(
    "--prompts",
    "prompt_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A prompt file (JSONL or one per line). Default: 8 built-in prompts.",
)
@click.option(
    "--humaneval",
    type=click.IntRange(min=1),
    default=None,
    help="Time the first N HumanEval problems (held-out code, asked as `mars eval --humaneval` asks them) instead of "
    "--prompts "
    "(needs pip install 'mars-mtp[eval]').",
)
@click.option("--raw", is_flag=True, help="Feed the prompts as plain text, without the chat template.")
@click.option(
    "--batch-sizes",
    default=",".join(map(str, B["batch_sizes"])),
    show_default=True,
    help="Comma-separated batch sizes.",
)
@click.option(
    "--threshold",
    "thresholds",
    type=float,
    multiple=True,
    help=f"A MARS threshold to time (repeat for several). Default: {B['thresholds'][0]}.",
)
@click.option(
    "--block-cache",
    "block_caches",
    default=",".join(map(str, B["block_caches"])),
    show_default=True,
    help="Comma-separated B_cache values for the block cache; 0 skips the block cache.",
)
@click.option(
    "--block-size", type=click.IntRange(min=1), default=None, help="Masks per step (default: the checkpoint's)."
)
@click.option("--metric", type=METRIC_CHOICE, default=None, help="Confidence metric (default: the checkpoint's).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=B["max_tokens"], show_default=True)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=B["repeats"],
    show_default=True,
    help="Timed rounds after the warm-up; medians are reported.",
)
@click.option(
    "--forward-k",
    "forward_ks",
    default=f"{B['forward_ks'][0]}-{B['forward_ks'][-1]}",
    show_default=True,
    help="New-token counts k of the per-forward cost curve (e.g. 1-32 or 1,2,4,8); 0 skips it.",
)
@click.option("--forward-repeats", type=click.IntRange(min=1), default=B["forward_repeats"], show_default=True)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the full report as JSON here.",
)
@click.option(
    "--force", is_flag=True, help="Allow thresholds < 1 on a model without mars.json (its mask guesses are untrained)."
)
@click.option(
    "--lossless",
    is_flag=True,
    help="Also time lossless decoding (window and each --block-cache); parity with AR reported (see above).",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Also time verified threshold mode at each --threshold (window cache, n-gram drafts per --ngram); "
    "parity reported as for --lossless.",
)
@click.option(
    "--window/--no-window",
    default=B["window"],
    show_default=True,
    help="Time MARS with the window cache (threshold and lossless).",
)
@click.option(
    "--prompt-lookup",
    type=click.IntRange(min=0),
    default=B["prompt_lookup"],
    show_default=True,
    help="torch: also time transformers prompt lookup decoding with this many draft tokens (one prompt at a time); 0 "
    "skips it.",
)
@click.option(
    "--ngram",
    type=click.IntRange(min=0),
    default=B["ngram"],
    show_default=True,
    help="--lossless: n-gram drafts of the default lossless configuration.",
)
@click.option(
    "--alternatives",
    type=click.IntRange(min=0),
    default=B["alternatives"],
    show_default=True,
    help="--lossless, --verify: the most runner-up groups of the default lossless configuration (0: none).",
)
@click.option(
    "--llama-cpp/--no-llama-cpp",
    default=B["llama_cpp"],
    show_default=True,
    help="Also time llama.cpp on the base model's GGUF (the embedded default's, or a --model .gguf) when "
    "llama-cpp-python is installed; one prompt at a time.",
)
@click.option(
    "--feed",
    "feeds",
    default=",".join(B["feeds"]),
    show_default=True,
    help="Threshold mode's feeds to time, comma-separated: auto (what mars generate runs: the masks per step chosen "
    "from "
    "this device's forward cost) and/or fixed (--block-size masks every step).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="torch CPU threads (default: torch's); fewer than the cores keeps timings steady on a shared machine.",
)
@click.option("--verbose", "-v", is_flag=True, help="Print every timed pass.")
@compile_option
@backend_option
@friendly_errors
def bench_command(
    model,
    adapter_path,
    prompt_file,
    humaneval,
    raw,
    batch_sizes,
    thresholds,
    block_caches,
    block_size,
    metric,
    max_tokens,
    repeats,
    forward_ks,
    forward_repeats,
    output,
    force,
    lossless,
    verify,
    window,
    prompt_lookup,
    ngram,
    alternatives,
    llama_cpp,
    feeds,
    threads,
    verbose,
    compile_steps,
    backend,
):
    """Time AR with KV cache, transformers/mlx_lm generation and MARS (window and block cache) side by side.

    \b
    Lossless and verified rows also report their parity with the AR row (untimed): replies
    identical to AR's in the same run and format (e.g. torch bfloat16, mlx 4-bit) and, per
    other reply, its first divergence with AR's top-2 logit gap there (largest minus
    second-largest logit, from a plain forward of the prompt and AR's reply up to it). A gap
    within a few units in the last place of the format at the logits' magnitude is a near-tie
    that rounding decides (a multi-token forward may round differently from a one-token
    forward outside float32), not an error of the method.
    """
    from ..bench import BenchError, benchmark, format_table
    from ..prompts import read_prompts

    try:
        settings = BenchSettings(
            batch_sizes=int_ranges(batch_sizes, "--batch-sizes"),
            thresholds=tuple(thresholds) or B["thresholds"],
            block_caches=() if block_caches.strip() == "0" else int_ranges(block_caches, "--block-cache"),
            max_tokens=max_tokens,
            repeats=repeats,
            block_size=block_size,
            metric=metric,
            forward_ks=() if forward_ks.strip() == "0" else int_ranges(forward_ks, "--forward-k"),
            forward_repeats=forward_repeats,
            force=force,
            lossless=lossless,
            verify=verify,
            window=window,
            prompt_lookup=prompt_lookup,
            ngram=ngram,
            alternatives=alternatives,
            llama_cpp=llama_cpp,
            feeds=tuple(f.strip() for f in feeds.split(",") if f.strip()),
        )
    except BenchError as e:
        raise click.UsageError(str(e)) from None
    if humaneval and prompt_file:
        raise click.UsageError("--humaneval and --prompts both name the prompts: pass one")
    if humaneval:
        from .. import humaneval as he

        try:
            prompts = [he.messages(p) for p in he.load_problems(humaneval)]
        except he.HumanEvalUnavailable as e:
            raise click.ClickException(str(e)) from None
        prompt_set = f"HumanEval, the first {len(prompts)} problems"
    else:
        prompts = read_prompts(prompt_file) if prompt_file else None
        prompt_set = str(prompt_file) if prompt_file else "built-in"
    quiet_libraries()
    try:
        report = benchmark(
            model,
            backend=backend,
            adapter_path=adapter_path,
            prompts=prompts,
            raw=raw,
            settings=settings,
            threads=threads,
            compile=compile_steps,
            announce=say,
            log=say if verbose else None,
            progress=not verbose,
        )
    except BenchError as e:
        raise click.ClickException(error_line(e)) from None
    report["prompt_set"] = prompt_set
    click.echo(format_table(report))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"wrote {output}", err=True)
