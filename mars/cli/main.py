"""The `mars` command: thin click wrappers that parse, call the library, and print."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import click

from .. import __version__
from ..core.config import GATED_FUSE_REFUSED, GATES, MODES
from .common import Finite

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def friendly_errors(fn):
    """Known bad input becomes a one-line error and exit status 1, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..backends.base import BackendUnavailable
        from ..backends.paths import ModelError
        from ..convert import ConvertError
        from ..core.acceptance import ThresholdError
        from ..core.config import ConfigError
        from ..core.data import DataError
        from ..core.files import OutputError
        from ..default_model import DefaultModelError

        known = (BackendUnavailable, ConfigError, ConvertError, DataError, DefaultModelError, FileNotFoundError, ModelError,
                 OutputError, ThresholdError)
        try:
            return fn(*args, **kwargs)
        except known as e:
            raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from None

    return wrapper


def backend_option(f):
    return click.option(
        "--backend",
        type=click.Choice(["auto", "torch", "mlx"]),
        default="auto",
        show_default=True,
        help="auto: MLX on Apple silicon, torch elsewhere.",
    )(f)


def model_options(f):
    f = click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto", show_default=True)(f)
    f = click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:1, mps or auto.")(f)
    f = click.option("--adapter-path", type=click.Path(path_type=Path), default=None, help="A LoRA adapter directory written by `mars finetune`.")(f)
    f = click.option("--model", default=None, help="HF model directory, .gguf file or MARS adapter directory. Default: the embedded SmolLM2-135M-Instruct.")(f)
    return f


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


@click.group()
@click.version_option(__version__, prog_name="mars")
def cli():
    """MARS: fine-tune a causal LM to emit several tokens per forward pass, and decode it with a speed knob."""


# ---------------------------------------------------------------------------------------------
# finetune


@cli.command()
@click.option("--model", default=None, help="Base model: HF directory or .gguf file. Default: the embedded SmolLM2-135M-Instruct.")
@click.option("--data", required=True, type=click.Path(path_type=Path), help="Directory with train.jsonl (valid.jsonl optional) or one .jsonl file.")
@click.option("--output", "--adapter-path", "output", required=True, type=click.Path(path_type=Path), help="Where the MARS checkpoint goes (an adapter directory under LoRA).")
@click.option("--fine-tune-type", type=click.Choice(["lora", "full"]), default="lora", show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=4, show_default=True, help="B: masks per block.")
@click.option("--ar-weight", type=Finite(min=0.0), default=1.0, show_default=True, help="alpha: weight of the clean-stream (AR) loss.")
@click.option("--iters", type=click.IntRange(min=0), default=0, help="Optimizer steps (overrides --epochs).")
@click.option("--epochs", type=Finite(min=0.0, min_open=True), default=1.0, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--grad-accumulation-steps", "grad_accumulation", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--learning-rate", type=Finite(min=0.0), default=1e-4, show_default=True)
@click.option("--warmup", type=Finite(0.0, 1.0), default=0.03, show_default=True, help="Warmup as a fraction of the steps.")
@click.option("--weight-decay", type=Finite(min=0.0), default=0.0, show_default=True)
@click.option("--max-seq-length", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--on-long", type=click.Choice(["error", "truncate", "skip"]), default="error", show_default=True, help="What to do with a sequence over --max-seq-length.")
@click.option("--lora-rank", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--lora-alpha", type=Finite(min=0.0, min_open=True), default=16.0, show_default=True)
@click.option("--lora-dropout", type=Finite(0.0, 1.0, max_open=True), default=0.0, show_default=True)
@click.option("--loss-normalization", "normalize", type=click.Choice(["row", "token"]), default="row", show_default=True, help="row: mean per row, then over rows (reference); token: one mean over all tokens.")
@click.option("--steps-per-eval", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--save-every", "steps_per_save", type=click.IntRange(min=1), default=100, show_default=True, help="Checkpoint every N steps (for --resume).")
@click.option("--default-threshold", type=Finite(), default=0.9, show_default=True, help="The threshold recorded in mars.json, used when `mars generate` gets none.")
@click.option("--default-mode", type=click.Choice(MODES), default="threshold", show_default=True,
              help="How `mars generate` / `mars chat` decode this checkpoint when given neither --threshold nor --lossless "
                   "(recorded in mars.json): at the default threshold, or lossless (output identical to AR).")
@click.option("--resume", is_flag=True, help="Continue from the checkpoint in --output.")
@click.option("--init-adapter", type=click.Path(path_type=Path), default=None, help="LoRA: start from this MARS adapter (e.g. weights/) instead of fresh LoRA layers; its rank, alpha and mask row are kept, and its block size unless --block-size names another.")
@click.option("--fuse", is_flag=True, help="LoRA: write the adapter fused into a full model (mask-token row included) instead of an adapter.")
@click.option("--objective", type=click.Choice(["ce", "distill"]), default="ce", show_default=True,
              help="The masks' target: ce = the label (the paper's recipe); distill = the model's own clean-stream distribution "
                   "at the same position (stop-gradient; with --gate masks, exactly the base model's).")
@click.option("--distill-temperature", type=Finite(min=0.0, min_open=True), default=1.0, show_default=True, help="--objective distill: softmax temperature of teacher and student.")
@click.option("--distill-mix", type=Finite(0.0, 1.0), default=1.0, show_default=True, help="--objective distill: weight of the KL term; the rest is the label's cross-entropy.")
@click.option("--gate", type=click.Choice(GATES), default="none", show_default=True,
              help="LoRA: masks = the adapter's deltas act at mask positions only, so every real token runs the base weights "
                   "and threshold 1.0 / lossless output is exactly the base model's (recorded in mars.json; cannot be fused).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True)
@backend_option
@friendly_errors
def finetune(model, data, output, backend, dtype, device, max_seq_length, on_long, resume, default_threshold, default_mode, fuse, init_adapter, **opts):
    """Fine-tune a model with the MARS objective (noisy + ar_weight x clean cross-entropy)."""
    from ..backends.base import resolve
    from ..backends.paths import ModelError, check_model_path, load_tokenizer, resolve_model_path
    from ..core.config import ConfigError, has_config
    from ..core.data import find_split_file, load_split
    from ..core.acceptance import check_threshold
    from ..core.files import check_output
    from ..core.training import TrainSettings
    from ..default_model import model_ref

    name = resolve(backend)
    quiet_libraries()
    if opts["block_size"] < 1:
        raise click.BadParameter("must be >= 1", param_hint="--block-size")
    if max_seq_length < opts["block_size"]:
        raise click.BadParameter(f"must be at least one block (--block-size {opts['block_size']})", param_hint="--max-seq-length")
    if fuse and opts["fine_tune_type"] != "lora":
        raise click.BadParameter("only applies to --fine-tune-type lora", param_hint="--fuse")
    if opts["gate"] != "none" and opts["fine_tune_type"] != "lora":
        raise click.BadParameter("gates LoRA deltas; it needs --fine-tune-type lora", param_hint="--gate")
    if fuse and opts["gate"] == "masks":
        raise click.BadParameter(GATED_FUSE_REFUSED, param_hint="--fuse")
    if not resume:
        check_output(output, sources=(data, model, init_adapter), fix="pass --resume to continue it, or choose a new --output")
    if resume and not (output / "checkpoint").is_dir():
        raise click.ClickException(f"{output}: no checkpoint to resume from")

    base_path, adapter = resolve_model_path(model, weights=False)  # no --model: train the plain base
    if adapter is not None:
        raise ModelError(f"{model}: is an adapter; fine-tune from its base model (or a fused model), or pass it as --init-adapter")
    check_model_path(base_path)
    init = check_init_adapter(init_adapter, base_path, opts) if init_adapter is not None else None
    check_threshold(init.metric if init is not None else "probability", default_threshold, name="--default-threshold")
    tokenizer = load_tokenizer(base_path)
    read = functools.partial(
        load_split, tokenizer=tokenizer, block_size=opts["block_size"], max_seq_length=max_seq_length, on_long=on_long
    )
    train = read(data, "train")
    valid = read(data, "valid") if find_split_file(data, "valid") else None
    for split in (train, valid):
        if split is not None and (split.truncated or split.skipped):
            click.echo(
                f"{split.path}: {split.truncated} truncated, {split.skipped} skipped over --max-seq-length {max_seq_length}",
                err=True,
            )
    click.echo(f"data: {len(train.examples)} train" + (f", {len(valid.examples)} valid" if valid else "") + " examples", err=True)

    say = lambda m: click.echo(m, err=True)  # noqa: E731
    if name == "mlx":
        from ..backends.mlx.model import ensure_mask_token, load
        from ..backends.mlx.train import MlxTrainer as Trainer

        tm = load(base_path, announce=say)
    else:
        from ..backends.torch.model import ensure_mask_token, load
        from ..backends.torch.train import Trainer

        if dtype == "auto" and opts["fine_tune_type"] == "full":
            dtype = "float32"  # trained weights stay float32; CUDA runs the forward under bfloat16 autocast
        tm = load(base_path, dtype=dtype, device=device, announce=say)
    if init is not None:
        mars = dataclasses.replace(init, block_size=opts["block_size"])
    else:
        mars = tm.mars if has_config(base_path) else None
    if mars is not None and mars.block_size != opts["block_size"]:
        raise ConfigError(f"{base_path / 'mars.json'}: block_size {mars.block_size} differs from --block-size {opts['block_size']}")
    mars = ensure_mask_token(tm.model, tm.tokenizer, mars, block_size=opts["block_size"], exclude=tm.eos_ids, announce=say)
    settings = TrainSettings(**opts, init_adapter=str(init_adapter) if init is not None else "")
    trainer = Trainer(tm, mars, settings, output)
    click.echo(
        f"training {settings.fine_tune_type} ({trainer.trainable:,} trainable parameters), B={settings.block_size}, "
        f"ar_weight={settings.ar_weight}, on {getattr(tm, 'device', 'mlx')}",
        err=True,
    )
    result = trainer.train(train.examples, valid.examples if valid else (), resume=resume, log=say)
    mars.default_threshold = default_threshold
    mars.default_mode = default_mode
    trainer.save(tm.tokenizer, model_ref(base_path), fuse=fuse)
    last = result["history"][-1] if result["history"] else {}
    summary = {k: round(v, 4) for k, v in last.items() if isinstance(v, float)}
    click.echo(f"saved {output} after {result['steps']} steps in {result['seconds']:.0f}s {json.dumps(summary)}")


def check_init_adapter(path: Path, base_path: Path, opts: dict):
    """The MARS config of an adapter to start LoRA from, after checking it fits this run;
    `opts` takes the adapter's block size, rank and alpha (they are what will train)."""
    from ..backends.paths import MASK_EMBEDDING_FILE, ModelError
    from ..convert.adapters import ConvertError, adapter_format, read_adapter
    from ..core.config import has_config, read_config
    from ..default_model import model_ref

    where = f"--init-adapter {path}"
    if opts["fine_tune_type"] != "lora":
        raise click.BadParameter("only applies to --fine-tune-type lora (a full model starts from --model)", param_hint="--init-adapter")
    try:
        fmt = adapter_format(path)
    except ConvertError as e:
        raise ModelError(f"{where}: {e}") from None
    if fmt is None:
        raise ModelError(f"{where}: not an adapter directory (adapter_config.json with adapter weights, no config.json)")
    if not has_config(path):
        raise ModelError(f"{where}: no mars.json (not a MARS adapter: its mask row and block size are unknown)")
    mars = read_config(path)
    if not (path / MASK_EMBEDDING_FILE).is_file():
        raise ModelError(f"{where}: no {MASK_EMBEDDING_FILE} (the trained mask-token row)")
    if mars.base_model and mars.base_model != model_ref(base_path):
        raise ModelError(f"{where}: trained on {mars.base_model}, not on {model_ref(base_path)}; pass --model {mars.base_model}")
    explicit = click.get_current_context().get_parameter_source("block_size") == click.core.ParameterSource.COMMANDLINE
    if not explicit:
        opts["block_size"] = mars.block_size
    elif opts["block_size"] != mars.block_size:
        # The masks do not depend on B: the j-th mask of a window predicts slot j whatever B is, so
        # a block size change keeps what the slots both sizes share learnt (a smaller B trains
        # those slots on more examples per token; a larger one starts the new slots from scratch).
        click.echo(f"--init-adapter: its block size {mars.block_size} becomes {opts['block_size']}; the masks keep slots 1-"
                   f"{min(mars.block_size, opts['block_size'])}", err=True)
    lora = read_adapter(path)
    opts["lora_rank"], opts["lora_alpha"] = lora.rank, lora.scale * lora.rank
    return mars


# ---------------------------------------------------------------------------------------------
# generate / chat


DEFAULT_NGRAM = 8  # most n-gram drafts a lossless step feeds


def decode_options(f):
    f = click.option("--threshold", type=float, default=None, help="Confidence threshold tau; 1.0 is plain greedy AR. Default: the checkpoint's default mode (mars.json), else 1.0.")(f)
    f = click.option("--block-size", type=click.IntRange(min=1), default=None, help="Masks per step (default: the checkpoint's block size).")(f)
    f = click.option("--metric", type=click.Choice(["probability", "entropy", "margin"]), default=None, help="Confidence metric (default: the checkpoint's).")(f)
    f = click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)(f)
    f = click.option("--temp", type=Finite(min=0.0), default=0.0, show_default=True, help="Sampling temperature; 0 is greedy.")(f)
    f = click.option("--top-p", type=Finite(0.0, 1.0, min_open=True), default=1.0, show_default=True)(f)
    f = click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)(f)
    f = click.option("--seed", type=int, default=None)(f)
    f = click.option("--cache", type=click.Choice(["window", "block", "none"]), default="window", show_default=True, help="window: sliding window on a KV cache; block: the block-level batch cache; none: no cache.")(f)
    f = click.option("--block-cache", type=click.IntRange(min=1), default=16, show_default=True, help="B_cache: slots per block of the block cache.")(f)
    f = click.option("--force", is_flag=True, help="Allow threshold < 1 on a model without mars.json (its mask guesses are untrained).")(f)
    f = click.option("--lossless", is_flag=True, help="The masks draft, the next forward verifies: output identical to AR (greedy or sampled); --threshold is ignored. "
                                                 "The default for a checkpoint whose mars.json has default_mode lossless, unless --threshold is given.")(f)
    f = click.option("--hedge", type=click.IntRange(min=0), default=None,
                     help="Lossless, greedy, window or no cache: spare mask groups fed per step, one after each of the first N "
                          "drafts, so a rejected draft still leaves drafts for the next step (each costs B more fed tokens). "
                          "Default: chosen per step from what a forward costs on this device (at most the block size); "
                          "giving N fixes it (0: none).")(f)
    f = click.option("--ngram", type=click.IntRange(min=0), default=DEFAULT_NGRAM, show_default=True,
                     help="Lossless, greedy, window or no cache: also draft up to N tokens by n-gram lookup in the prompt and "
                          "the reply, where lookup is expected to keep more than the masks; 0: masks only.")(f)
    return f


class Session:
    """A loaded model plus the decoding settings a command uses."""

    def __init__(self, model, adapter_path, dtype, device, backend):
        from ..backends.base import loader, resolve

        load, decoder = loader(resolve(backend))
        quiet_libraries()
        say = lambda m: click.echo(m, err=True)  # noqa: E731
        self.tm = load(model, adapter_path=adapter_path, dtype=dtype, device=device, announce=say)
        self.decoder = decoder(self.tm)
        self._cost = None
        self._policies = {}

    def cost_for(self, settings):
        """The per-forward cost curve when `settings` chooses its feed per step (greedy
        lossless with the window cache or none, `--hedge` not given), else None."""
        from ..backends.base import cost_curve

        if not (settings.lossless and settings.sampling.greedy and settings.cache != "block" and settings.hedge is None):
            return None
        from ..core.cost import FeedPolicy

        if self._cost is None:
            self._cost = cost_curve(self.tm, self.decoder, announce=lambda m: click.echo(m, err=True))
        key = (settings.block_size, settings.hedges)
        if key not in self._policies:  # one per block size: it keeps what it learns across calls
            self._policies[key] = FeedPolicy(self._cost, *key)
        return self._policies[key]

    def settings(self, threshold, block_size, metric, max_tokens, temp, top_p, top_k, seed, cache, block_cache, force, lossless=False, hedge=None,
                 ngram=DEFAULT_NGRAM):
        from ..core.acceptance import ar_threshold, check_threshold, is_ar_mode
        from ..core.decoding import DecodeSettings, Sampling
        from ..backends.base import mask_id_for

        mars = self.tm.mars
        metric = metric or (mars.metric if mars else "probability")
        if threshold is not None:
            threshold = check_threshold(metric, threshold, name="--threshold")
            if lossless:
                warn("--threshold is ignored with --lossless (lossless output is AR's whatever the threshold)")
        if threshold is None:
            # No threshold asked for: the checkpoint's default mode decides (mars.json).
            lossless = lossless or (mars is not None and mars.lossless_by_default)
            threshold = mars.default_threshold if mars else ar_threshold(metric)
        if mars is None and not is_ar_mode(metric, threshold) and not lossless:
            if not force:
                raise click.ClickException(
                    "this model has no mars.json (never MARS-trained): its mask predictions are confidently wrong; "
                    "use --threshold 1.0, or --force to try anyway"
                )
            click.echo("WARNING: decoding a model without MARS training below threshold 1.0: expect wrong tokens", err=True)
        mask_id = mask_id_for(self.tm)
        settings = DecodeSettings(
            mask_id=mask_id,
            eos_ids=self.tm.eos_ids,
            block_size=block_size or (mars.block_size if mars else 4),
            threshold=threshold,
            metric=metric,
            max_tokens=max_tokens,
            cache=cache,
            block_cache=block_cache,
            sampling=Sampling(temperature=temp, top_p=top_p, top_k=top_k, seed=seed),
            lossless=lossless,
            hedge=hedge,
            ngram=ngram,
        )
        if hedge is not None and hedge > 0 and settings.no_spare_groups:
            warn(f"--hedge is ignored here: {settings.no_spare_groups}")
        return settings


def warn(message: str) -> None:
    click.echo(f"note: {message}", err=True)


def mode(settings) -> str:
    """How a run decodes, for the summary lines."""
    if settings.lossless:
        return "lossless" + (f" sampling (temp {settings.sampling.temperature:g})" if not settings.sampling.greedy else " greedy")
    return f"threshold {settings.threshold} ({settings.metric})"


def read_prompts(path: Path) -> list:
    """A prompt file: JSONL of {"prompt": ...} or {"messages": [...]}, or plain text, one prompt per line."""
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line)
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise click.ClickException(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            prompts.append(rec["prompt"])
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            msgs = rec["messages"]
            prompts.append(msgs[:-1] if msgs and msgs[-1].get("role") == "assistant" else msgs)
        else:
            raise click.ClickException(f'{path}:{n}: expected {{"prompt": ...}} or {{"messages": [...]}}')
    if not prompts:
        raise click.ClickException(f"{path}: no prompts")
    return prompts


@cli.command()
@model_options
@click.option("--prompt", "prompt_texts", multiple=True, help="A prompt (repeat for several).")
@click.option("--prompts", "prompt_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="A file of prompts: JSONL ({\"prompt\"} or {\"messages\"}) or one per line.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--raw", is_flag=True, help="Feed the prompt as plain text, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt (text, tokens, statistics).")
@click.option("--compare", is_flag=True, help="Also run the prompts as plain greedy AR (threshold 1.0) and print both side by side.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="--compare: timed rounds, AR and the mode interleaved; the speed ratio is their median.")
@decode_options
@backend_option
@friendly_errors
def generate(model, adapter_path, dtype, device, prompt_texts, prompt_file, batch_size, raw, as_json, compare, rounds, backend, **decode):
    """Generate replies; prints the text and tokens per forward."""
    import dataclasses

    from ..core.acceptance import ar_threshold
    from ..core.tokens import encode_prompt

    prompts = list(prompt_texts) + (read_prompts(prompt_file) if prompt_file else [])
    if not prompts:
        raise click.UsageError("give --prompt TEXT or --prompts FILE")
    session = Session(model, adapter_path, dtype, device, backend)
    settings = session.settings(**decode)
    tok = session.tm.tokenizer
    ids = [encode_prompt(tok, p, chat=not raw) for p in prompts]
    runs = [settings]
    if compare:
        ar = dataclasses.replace(settings, threshold=ar_threshold(settings.metric), lossless=False)
        runs = [ar, settings]
    for s in runs:
        session.cost_for(s)  # measured (once per device) before anything is timed
    results = [_decode_batches(session, ids, s, batch_size) for s in runs]
    ratios = []
    if compare:
        # Rounds interleave AR and the mode, so drift on a busy machine hits both alike.
        for n in range(rounds):
            timed = results if n == 0 else [_decode_batches(session, ids, s, batch_size) for s in runs]
            ratios.append((timed[1]["tokens_total"] / timed[1]["seconds"]) / max(1e-9, timed[0]["tokens_total"] / timed[0]["seconds"]))
    for i, p in enumerate(prompts):
        texts = [tok.decode(r["tokens"][i], skip_special_tokens=True) for r in results]
        if as_json:
            for s, r, text in zip(runs, results, texts):
                row = r["rows"][i]
                click.echo(json.dumps({"prompt": p, "mode": mode(s), "text": text, "tokens": len(r["tokens"][i]), "finish": r["finish"][i],
                                       "forwards": row.forwards, "tokens_per_forward": round(row.tokens_per_forward, 3)}))
            continue
        click.echo(f"--- [{i}] {p if isinstance(p, str) else p[-1]['content']}")
        if compare:
            click.echo(f"[{mode(runs[0])}]")
            click.echo(texts[0])
            click.echo(f"[{mode(runs[1])}]" + ("  (same text)" if texts[1] == texts[0] else ""))
        click.echo(texts[-1])
    lines = [_summary(s, r) for s, r in zip(runs, results)]
    if compare:
        same = sum(a == b for a, b in zip(results[0]["tokens"], results[1]["tokens"]))
        spread = f" (median of {rounds} interleaved rounds, {min(ratios):.2f}-{max(ratios):.2f})" if rounds > 1 else " (one round)"
        lines.append(f"{same}/{len(prompts)} replies identical to AR; {statistics.median(ratios):.2f}x AR's tokens/s{spread}")
    for line in lines:
        click.echo(line, err=as_json)


def _decode_batches(session, ids, settings, batch_size) -> dict:
    from ..core.decoding import generate as run

    tokens, finish, rows = [], [], []
    t0 = time.perf_counter()
    for start in range(0, len(ids), batch_size):
        result = run(session.decoder, ids[start : start + batch_size], settings, cost=session.cost_for(settings))
        tokens += result.tokens
        finish += result.finish
        rows += result.stats.rows
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "finish": finish, "rows": rows, "seconds": seconds,
            "tokens_total": sum(r.accepted for r in rows), "forwards": sum(r.forwards for r in rows)}


def _summary(settings, r: dict) -> str:
    n, f, sec = r["tokens_total"], r["forwards"], r["seconds"]
    line = (
        f"{mode(settings)}, B={settings.block_size}, cache={settings.cache}: {n} tokens, {f} forwards, "
        f"{n / max(1, f):.2f} tokens/forward, {sec:.2f}s ({n / max(sec, 1e-9):.1f} tok/s)"
    )
    return line + sources_text(r["rows"])


def sources_text(rows) -> str:
    """Lossless: where the tokens came from (drafts kept, by source; one AR token a step)."""
    from ..core.decoding import DecodeStats

    total = DecodeStats(rows=list(rows)).by_source()
    if not total:
        return ""
    names = {"masks": "mask drafts", "spare": "spare-group drafts", "ngram": "n-gram drafts", "ar": "AR"}
    return "; tokens from " + ", ".join(f"{names[k]} {total[k]}" for k in names if total.get(k))


@cli.command()
@model_options
@click.option("--system", default=None, help="A system message.")
@decode_options
@backend_option
@friendly_errors
def chat(model, adapter_path, dtype, device, system, backend, **decode):
    """Interactive chat that streams tokens as they are accepted.

    Commands: /threshold 0.9 (decode at this threshold), /lossless (decode losslessly),
    /reset (forget the conversation), /help, /quit. A message that starts with "/" is sent
    by doubling it: "//etc/hosts is a file" sends "/etc/hosts is a file".
    """
    from ..core.decoding import generate as run
    from ..core.tokens import encode_prompt

    session = Session(model, adapter_path, dtype, device, backend)
    settings = session.settings(**decode)
    tok = session.tm.tokenizer
    history = [{"role": "system", "content": system}] if system else []
    click.echo(f"{mode(settings)}, B={settings.block_size}. /help lists the commands", err=True)
    while True:
        try:
            line = input(">> ")
        except (EOFError, KeyboardInterrupt):
            click.echo("")
            return
        line = line.strip()
        if not line:
            continue
        if line.startswith("/") and not line.startswith("//"):
            command = line.split()[0]
            if command in ("/quit", "/exit"):
                return
            if command == "/reset":
                history = history[:1] if system else []
                continue
            chat_command(line, settings, session, force=decode["force"])
            continue
        if line.startswith("//"):
            line = line[1:]
        history.append({"role": "user", "content": line})
        ids = encode_prompt(tok, history)
        out: list[int] = []
        shown = ""

        def stream(row, new):
            nonlocal shown
            out.extend(new)
            text = tok.decode(out, skip_special_tokens=True)
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

        t0 = time.perf_counter()
        result = run(session.decoder, [ids], settings, on_tokens=stream, cost=session.cost_for(settings))
        dt = time.perf_counter() - t0
        st = result.stats.rows[0]
        click.echo("")
        click.echo(f"[{st.accepted} tokens, {st.forwards} forwards, {st.tokens_per_forward:.2f} tokens/forward, {dt:.2f}s]", err=True)
        history.append({"role": "assistant", "content": shown})


CHAT_HELP = """commands:
  /threshold X   decode in threshold mode at X (1.0 is plain greedy AR)
  /lossless      decode losslessly (the masks draft, the next forward verifies)
  /reset         forget the conversation
  /help          this list
  /quit          leave (also /exit, Ctrl-D)
a message that starts with "/" is sent by doubling the slash: //etc/hosts ..."""


def chat_command(line: str, settings, session, *, force: bool) -> None:
    """Carry out a chat slash command (not /quit or /reset), reporting on stderr; never sends text to the model."""
    from ..core.acceptance import ThresholdError, ar_threshold, check_threshold, is_ar_mode

    parts = line.split()
    command = parts[0]
    if command == "/help":
        click.echo(CHAT_HELP, err=True)
    elif command == "/threshold":
        if len(parts) != 2:
            click.echo("usage: /threshold 0.9", err=True)
            return
        try:
            threshold = check_threshold(settings.metric, float(parts[1]))
        except ValueError as e:
            why = str(e) if isinstance(e, ThresholdError) else f"{parts[1]!r} is not a number"
            click.echo(f"{why}; keeping {mode(settings)}", err=True)
            return
        if session.tm.mars is None and not is_ar_mode(settings.metric, threshold) and not force:
            click.echo("this model has no mars.json: keeping plain AR (start with --force to override)", err=True)
            threshold = ar_threshold(settings.metric)
        settings.threshold = threshold
        settings.lossless = False
        click.echo(mode(settings), err=True)
    elif command == "/lossless":
        settings.lossless = True
        click.echo(mode(settings), err=True)
    else:
        click.echo(f"unknown command {command}; /help lists the commands (start a message with // to send a leading /)", err=True)


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--to", "to", type=click.Choice(["hf", "mlx"]), required=True, help="Output format: Hugging Face (transformers / PEFT) or mlx-lm.")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="The directory to write (a new or empty one, unless --overwrite).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --output (atomically, once the conversion has succeeded).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None, help="Cast float tensors (default: keep each tensor's type).")
@click.option("-q", "--quantize", "quantize", is_flag=True, help="Quantize to mlx-lm affine layers (--to mlx).")
@click.option("--q-bits", type=click.Choice(["2", "3", "4", "5", "6", "8"]), default="4", show_default=True, help="Bits per weight (-q).")
@click.option("--q-group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True, help="Weights per scale and bias (-q).")
@click.option("--adapter", "adapter", type=click.Path(path_type=Path), default=None, help="A LoRA adapter (PEFT or mlx-lm) to fuse into SRC; needs --fuse.")
@click.option("--fuse", is_flag=True, help="Write SRC with --adapter fused in as one full model.")
@click.option("--model", "base", type=click.Path(path_type=Path), default=None, help="Adapter SRC: the base model, to place a PEFT adapter's layers for mlx-lm.")
@friendly_errors
def convert(src, to, output, overwrite, dtype, quantize, q_bits, q_group_size, adapter, fuse, base):
    """Convert a model (HF / mlx-lm directory, or .gguf) or a LoRA adapter (PEFT <-> mlx-lm) into --to's format.

    SRC and --model may also be default:SmolLM2-135M-Instruct, the embedded default model."""
    from ..convert import ConvertError, adapter_format, convert_adapter, convert_model
    from ..default_model import DEFAULT_REF, default_model_dir

    say = lambda m: click.echo(m, err=True)  # noqa: E731
    src, base = (default_model_dir(announce=say) if p is not None and str(p) == DEFAULT_REF else p for p in (src, base))
    if adapter is not None and not fuse:
        raise ConvertError("--adapter fuses an adapter into SRC; add --fuse (or give the adapter directory as SRC to convert it)")
    if fuse and adapter is None:
        raise ConvertError("--fuse needs --adapter ADAPTER_DIR")
    if adapter_format(src) is not None:
        if quantize or dtype or fuse:
            raise ConvertError(f"{src}: an adapter converts as it is; --dtype, -q and --fuse apply to models")
        out = convert_adapter(src, output, to, base=base, overwrite=overwrite)
    else:
        out = convert_model(
            src, output, to, dtype=dtype, q_bits=int(q_bits) if quantize else None, q_group_size=int(q_group_size),
            adapter=adapter, overwrite=overwrite, announce=say,
        )
    click.echo(f"wrote {out}")


# Commands in their own modules (they import helpers from this one).
from .bench import bench_command  # noqa: E402
from .distill import distill_command  # noqa: E402
from .evaluate import evaluate_command  # noqa: E402
from .serve import serve_command  # noqa: E402

cli.add_command(evaluate_command)
cli.add_command(bench_command)
cli.add_command(distill_command)
cli.add_command(serve_command)


def main():
    cli()


if __name__ == "__main__":
    main()
