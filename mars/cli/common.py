"""Click pieces the `mars` subcommands share (no import of the command modules): option types
and groups, error handling, opening a model, and the plan the decoding options ask for."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import re
import warnings
from pathlib import Path

import click

from ..core.acceptance import METRICS

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METRIC_CHOICE = click.Choice(METRICS)
DTYPE_CHOICE = click.Choice(["auto", "float32", "float16", "bfloat16"])
CACHE_CHOICE = click.Choice(["window", "block", "none"])
FORCE_HINT = "--force decodes anyway"


class Finite(click.FloatRange):
    """A float option that refuses nan and infinities as well as values outside its range."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def defaults(source) -> dict:
    """The defaults of a settings dataclass's fields, or of a function's keyword arguments: where
    the options take their defaults from, so that each is written once."""
    if dataclasses.is_dataclass(source):
        return {f.name: f.default for f in dataclasses.fields(source) if f.default is not dataclasses.MISSING}
    return {
        name: p.default
        for name, p in inspect.signature(source).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def say(message: str) -> None:
    """Progress and notes go to stderr, so stdout holds only the results."""
    click.echo(message, err=True)


def warn(message: str) -> None:
    click.echo(f"note: {message}", err=True)


# Library errors name a setting as `name=value` (or `name=` alone); the CLI says the flag.
_SETTING = re.compile(r"\b(max_seq_length|on_long|block_size|gate|device)=")


def as_flags(text: str) -> str:
    """`max_seq_length=512` -> `--max-seq-length 512`, `on_long=skip` -> `--on-long skip`, and
    `raise max_seq_length=,` -> `raise --max-seq-length,`."""
    text = _SETTING.sub(lambda m: "--" + m.group(1).replace("_", "-") + " ", text)
    return re.sub(r"(--[a-z-]+) (?=[,;)]|$)", r"\1", text)


def error_line(error: Exception) -> str:
    """An error as one line, naming flags where the library names settings; refusing to decode
    an untrained model below AR mode adds how to insist."""
    from ..core.decode.rules import UntrainedModelError

    text = as_flags(str(error).splitlines()[0]) if str(error) else type(error).__name__
    untrained = isinstance(error, UntrainedModelError) or isinstance(error.__cause__, UntrainedModelError)
    return f"{text}; {FORCE_HINT}" if untrained else text


def friendly_errors(fn):
    """Known bad input becomes a one-line error and exit status 1, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..backends.base import BackendUnavailable
        from ..checkpoint.default_model import DefaultModelError
        from ..checkpoint.paths import ModelError
        from ..convert import ConvertError
        from ..core.acceptance import ThresholdError
        from ..core.config import ConfigError
        from ..core.decode.drafts.corpus import CorpusError
        from ..core.decode.rules import UntrainedModelError
        from ..core.files import OutputError
        from ..core.train.data import DataError

        known = (
            BackendUnavailable,
            ConfigError,
            ConvertError,
            CorpusError,
            DataError,
            DefaultModelError,
            FileNotFoundError,
            ModelError,
            OutputError,
            ThresholdError,
            UntrainedModelError,
        )
        try:
            return fn(*args, **kwargs)
        except known as e:
            raise click.ClickException(error_line(e)) from None

    return wrapper


def backend_option(f):
    return click.option(
        "--backend",
        type=click.Choice(["auto", "torch", "mlx"]),
        default="auto",
        show_default=True,
        help="auto: MLX on Apple silicon, torch elsewhere.",
    )(f)


def device_options(f):
    f = click.option(
        "--dtype",
        type=DTYPE_CHOICE,
        default="auto",
        show_default=True,
        help="The number format the model runs in; auto: float32, bfloat16 on a CUDA device that "
        "supports it. Lossless output equals AR's exactly in float32, and up to near-ties of "
        'AR\'s two best logits in narrower formats (README, "Formats").',
    )(f)
    return click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:1, mps or auto.")(f)


def model_options(f):
    return model_path_options(device_options(f))


def model_path_options(f):
    f = click.option(
        "--adapter-path",
        type=click.Path(path_type=Path),
        default=None,
        help="A LoRA adapter directory written by `mars finetune`.",
    )(f)
    f = click.option(
        "--model",
        default=None,
        help="HF model directory, .gguf file or MARS adapter directory. Default: the embedded SmolLM2-135M-Instruct.",
    )(f)
    return f


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def open_session(model, adapter_path, dtype, device, backend, remeasure_cost: bool = False, compile: str = "off"):
    """The model loaded for decoding (mars.session.Session), notes on stderr."""
    from ..session import Session

    quiet_libraries()
    return Session(
        model,
        adapter_path,
        backend=backend,
        dtype=dtype,
        device=device,
        announce=say,
        remeasure_cost=remeasure_cost,
        compile=compile,
    )


def compile_option(f):
    """--compile auto|on|off: the decoding steps under torch.compile or mx.compile (mars.session.compiles)."""
    return click.option(
        "--compile",
        "compile_steps",
        type=click.Choice(["auto", "on", "off"]),
        default="auto",
        show_default=True,
        help="Run the decoding steps compiled: torch.compile (torch backend, mars's own forward; a graph per "
        "kind of step, tens of seconds each on a CPU, kept under the cache directory) or mx.compile (MLX; "
        "seconds). auto compiles on CUDA and Apple silicon's GPU; on also on a CPU. Replies are the same "
        "either way.",
    )(f)


# -- decoding options (generate, chat) ---------------------------------------------------------------


def decode_options(f):
    from ..core.decode.plan import FEEDS, Plan, Sampling
    from ..core.decode.rules import DEFAULT_ALTERNATIVES, DEFAULT_NGRAM

    d, s = defaults(Plan), defaults(Sampling)
    f = click.option(
        "--threshold",
        type=float,
        default=None,
        help="Confidence threshold tau; 1.0 is plain greedy AR. Default: the checkpoint's default mode (mars.json), "
        "else 1.0.",
    )(f)
    f = click.option(
        "--block-size",
        type=click.IntRange(min=1),
        default=None,
        help="Masks per step (default: the checkpoint's block size).",
    )(f)
    f = click.option(
        "--metric", type=METRIC_CHOICE, default=None, help="Confidence metric (default: the checkpoint's)."
    )(f)
    f = click.option("--max-tokens", type=click.IntRange(min=1), default=d["max_tokens"], show_default=True)(f)
    f = click.option(
        "--temp",
        type=Finite(min=0.0),
        default=s["temperature"],
        show_default=True,
        help="Sampling temperature; 0 is greedy.",
    )(f)
    f = click.option("--top-p", type=Finite(0.0, 1.0, min_open=True), default=s["top_p"], show_default=True)(f)
    f = click.option("--top-k", type=click.IntRange(min=0), default=s["top_k"], show_default=True)(f)
    f = click.option("--seed", type=int, default=None)(f)
    f = click.option(
        "--cache",
        type=CACHE_CHOICE,
        default=d["cache"],
        show_default=True,
        help="window: sliding window on a KV cache; block: the block-level batch cache; none: no cache.",
    )(f)
    f = click.option(
        "--block-cache",
        type=click.IntRange(min=1),
        default=d["block_cache"],
        show_default=True,
        help="B_cache: slots per block of the block cache.",
    )(f)
    f = click.option(
        "--force",
        is_flag=True,
        help="Allow threshold < 1 on a model without mars.json (its mask guesses are untrained).",
    )(f)
    f = click.option(
        "--lossless",
        is_flag=True,
        help="The masks draft, the next forward verifies: output identical to AR (greedy or sampled); --threshold is "
        "ignored. "
        "The default for a checkpoint whose mars.json has default_mode lossless, unless --threshold is given.",
    )(f)
    f = click.option(
        "--verify/--no-verify",
        default=None,
        help="Threshold mode, greedy: verified threshold mode (the default there). Also feed drafts (the masks' "
        "proposals not taken, spare groups', n-gram lookup's) and keep those AR agrees with, as --lossless "
        "does, while taking confident proposals unverified; runs with the window cache (or none). "
        "--no-verify: plain threshold mode, which drops the proposals it does not take.",
    )(f)
    f = click.option(
        "--hedge",
        type=click.IntRange(min=0),
        default=None,
        help="Lossless, greedy, window or no cache: spare mask groups fed per step, one after each of the first N "
        "drafts, so a rejected draft still leaves drafts for the next step (each costs B more fed tokens). "
        "Default: chosen per step from what a forward costs on this device (at most the block size); "
        "giving N fixes it (0: none).",
    )(f)
    f = click.option(
        "--feed",
        type=click.Choice(FEEDS),
        default=None,
        help="auto: choose per step how many masks (and spare groups) to feed from what a forward costs on this "
        "device, AR's own feed when masks do not pay (lossless output is AR's either way; threshold-mode "
        "text may then differ from device to device and with the batch); fixed: always --block-size masks. "
        "Default: auto, fixed where --hedge fixes the spare groups.",
    )(f)
    f = click.option(
        "--ngram",
        type=click.IntRange(min=0),
        default=DEFAULT_NGRAM,
        show_default=True,
        help="Lossless, greedy, window or no cache: also draft up to N tokens by n-gram lookup in the prompt and "
        "the reply, where lookup is expected to keep more than the masks; 0: masks only.",
    )(f)
    f = click.option(
        "--corpus",
        default=None,
        metavar="PATH|none",
        help="With --ngram > 0: also draft from this draft corpus (`mars corpus`), where it is expected to keep "
        "more; 'none': no corpus drafts. Default: the checkpoint's draft_corpus.npz, if it has one.",
    )(f)
    f = compile_option(f)
    f = click.option(
        "--remeasure-cost",
        is_flag=True,
        help="Measure again what a forward costs on this device (the curve --feed auto decides on, measured "
        "once and kept under the cache directory), e.g. after it was measured on a busy machine.",
    )(f)
    f = click.option(
        "--alternatives",
        type=click.IntRange(min=0),
        default=DEFAULT_ALTERNATIVES,
        show_default=True,
        help="Lossless, greedy, window or no cache: also feed up to N runners-up of the first draft, each with B "
        "masks, so that where the first draft is wrong and AR's token is a runner-up the step takes one more "
        "token and better drafts (each costs 1 + B fed tokens; with --feed auto fed only where it pays); 0: none.",
    )(f)
    f = click.option(
        "--tree",
        default="auto",
        show_default=True,
        callback=tree_nodes,
        metavar="N|auto",
        help="Lossless (greedy or sampled), any cache: also feed up to N tree nodes a step, the masks' "
        "runners-up off the chain of drafts by path probability, each with B masks (each costs 1 + B fed tokens; "
        "with --feed auto as many as pay); 0: the chain alone; auto: up to 16 where --feed auto sizes them "
        "from this device's forward cost, none with a fixed feed.",
    )(f)
    return f


def tree_nodes(ctx, param, value):
    """--tree: a count of nodes (>= 0) or auto."""
    if isinstance(value, int) or value is None:
        return value
    if value.strip().lower() == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise click.BadParameter(f"{value!r}: a number of tree nodes (0 or more) or auto")
    return n


def plan_from_options(
    session,
    threshold,
    block_size,
    metric,
    max_tokens,
    temp,
    top_p,
    top_k,
    seed,
    cache,
    block_cache,
    force,
    lossless,
    hedge,
    ngram,
    feed=None,
    verify=None,
    alternatives=0,
    corpus=None,
    logprobs=None,
    tree="auto",
):
    """The plan the decoding options ask for on the session's model (mars.core.decode.plan), with a
    note for each option that has no effect."""
    from ..core.acceptance import check_threshold
    from ..core.decode.drafts.corpus import DraftCorpus
    from ..core.decode.plan import Mode, Sampling, why_not_verified
    from ..core.decode.rules import metric_for

    drafts = {}  # no --corpus: the checkpoint's own (mars.backends.base.draft_corpus)
    if corpus is not None:
        drafts["corpus"] = None if corpus.lower() == "none" else DraftCorpus.load(Path(corpus))
        if drafts["corpus"] is not None and not ngram:
            warn("--corpus is ignored with --ngram 0 (corpus drafts share the n-gram drafts' limit)")

    if threshold is not None:
        check_threshold(metric_for(session.mars, metric), threshold, name="--threshold")
        if lossless:
            warn("--threshold is ignored with --lossless (lossless output is AR's whatever the threshold)")
    settings = session.plan(
        threshold=threshold,
        lossless=lossless,
        verify=verify,
        metric=metric,
        block_size=block_size,
        force=force,
        warn=lambda m: click.echo(f"WARNING: {m}", err=True),
        max_tokens=max_tokens,
        cache=cache,
        block_cache=block_cache,
        sampling=Sampling(temperature=temp, top_p=top_p, top_k=top_k, seed=seed),
        hedge=hedge,
        ngram=ngram,
        feed=feed,
        alternatives=alternatives,
        tree=tree,
        logprobs=logprobs,
        **drafts,
    )
    if verify and settings.mode is not Mode.VERIFIED:  # asked for by name where it cannot apply
        warn(f"--verify is ignored here: {why_not_verified(settings)}")
    if hedge is not None and hedge > 0 and settings.no_spare_groups:
        warn(f"--hedge is ignored here: {settings.no_spare_groups}")
    return settings
