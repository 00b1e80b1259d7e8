"""`mars finetune`: parse the options, call mars.finetune.finetune, print the summary."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..core.config import GATES, MODES
from ..core.train.loop import CHECKPOINT, TrainingInterrupted, TrainSettings
from ..finetune import FinetuneError, finetune
from .common import Finite, as_flags, backend_option, defaults, device_options, friendly_errors, quiet_libraries, say
from .interrupt import Interrupted, rerun_command

T, F = defaults(TrainSettings), defaults(finetune)  # the options' defaults
FLAGS = {
    "steps_per_save": "--save-every",
    "grad_accumulation": "--grad-accumulation-steps",
    "normalize": "--loss-normalization",
}


def _floats(value: str, param) -> tuple[float, ...]:
    """A comma-separated list of numbers as floats ("" is none)."""
    try:
        return tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a comma-separated list of numbers (e.g. 1,1.5,2,2.5)", param=param
        ) from None


@click.command("finetune")
@click.option(
    "--model", default=None, help="Base model: HF directory or .gguf file. Default: the embedded SmolLM2-135M-Instruct."
)
@click.option(
    "--data",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory with train.jsonl (valid.jsonl optional) or one .jsonl file.",
)
@click.option(
    "--output",
    "--adapter-path",
    "output",
    required=True,
    type=click.Path(path_type=Path),
    help="Where the MARS checkpoint goes (an adapter directory under LoRA).",
)
@click.option("--fine-tune-type", type=click.Choice(["lora", "full"]), default=T["fine_tune_type"], show_default=True)
@click.option(
    "--block-size", type=click.IntRange(min=1), default=T["block_size"], show_default=True, help="B: masks per block."
)
@click.option(
    "--ar-weight",
    type=Finite(min=0.0),
    default=T["ar_weight"],
    show_default=True,
    help="alpha: weight of the clean-stream (AR) loss.",
)
@click.option("--iters", type=click.IntRange(min=0), default=T["iters"], help="Optimizer steps (overrides --epochs).")
@click.option("--epochs", type=Finite(min=0.0, min_open=True), default=T["epochs"], show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=T["batch_size"], show_default=True)
@click.option(
    "--grad-accumulation-steps",
    "grad_accumulation",
    type=click.IntRange(min=1),
    default=T["grad_accumulation"],
    show_default=True,
)
@click.option("--learning-rate", type=Finite(min=0.0), default=T["learning_rate"], show_default=True)
@click.option(
    "--warmup", type=Finite(0.0, 1.0), default=T["warmup"], show_default=True, help="Warmup as a fraction of the steps."
)
@click.option("--weight-decay", type=Finite(min=0.0), default=T["weight_decay"], show_default=True)
@click.option("--max-seq-length", type=click.IntRange(min=1), default=F["max_seq_length"], show_default=True)
@click.option(
    "--on-long",
    type=click.Choice(["error", "truncate", "skip"]),
    default=F["on_long"],
    show_default=True,
    help="What to do with a sequence over --max-seq-length.",
)
@click.option("--lora-rank", type=click.IntRange(min=1), default=T["lora_rank"], show_default=True)
@click.option("--lora-alpha", type=Finite(min=0.0, min_open=True), default=T["lora_alpha"], show_default=True)
@click.option("--lora-dropout", type=Finite(0.0, 1.0, max_open=True), default=T["lora_dropout"], show_default=True)
@click.option(
    "--loss-normalization",
    "normalize",
    type=click.Choice(["row", "token"]),
    default=T["normalize"],
    show_default=True,
    help="row: mean per row, then over rows (reference); token: one mean over all tokens.",
)
@click.option("--steps-per-eval", type=click.IntRange(min=1), default=T["steps_per_eval"], show_default=True)
@click.option(
    "--val-batches",
    type=click.IntRange(min=-1),
    default=T["val_batches"],
    show_default=True,
    help="Batches of valid.jsonl per validation pass (the same ones each time); -1: all of them.",
)
@click.option(
    "--save-every",
    "steps_per_save",
    type=click.IntRange(min=1),
    default=T["steps_per_save"],
    show_default=True,
    help="Checkpoint every N steps (for --resume).",
)
@click.option(
    "--default-threshold",
    type=Finite(min=0.0),
    default=F["default_threshold"],
    show_default=True,
    help="The threshold recorded in mars.json, used when `mars generate` gets none.",
)
@click.option(
    "--default-mode",
    type=click.Choice(MODES),
    default=F["default_mode"],
    show_default=True,
    help="How `mars generate` / `mars chat` decode this checkpoint when given neither --threshold nor --lossless "
    "(recorded in mars.json): at the default threshold, or lossless (output identical to AR).",
)
@click.option("--resume", is_flag=True, help="Continue from the checkpoint in --output.")
@click.option(
    "--init-adapter",
    type=click.Path(path_type=Path),
    default=None,
    help="LoRA: start from this MARS adapter (e.g. weights/) instead of fresh LoRA layers; its rank, alpha and mask "
    "row are kept, and its block size unless --block-size names another.",
)
@click.option(
    "--fuse",
    is_flag=True,
    help="LoRA: write the adapter fused into a full model (mask-token row included) instead of an adapter.",
)
@click.option(
    "--objective",
    type=click.Choice(["ce", "distill"]),
    default=T["objective"],
    show_default=True,
    help="The masks' target: ce = the label (the paper's recipe); distill = the model's own clean-stream distribution "
    "at the same position (stop-gradient; with --gate masks, exactly the base model's).",
)
@click.option(
    "--distill-temperature",
    type=Finite(min=0.0, min_open=True),
    default=T["distill_temperature"],
    show_default=True,
    help="--objective distill: softmax temperature of teacher and student.",
)
@click.option(
    "--distill-mix",
    type=Finite(0.0, 1.0),
    default=T["distill_mix"],
    show_default=True,
    help="--objective distill: weight of the KL term; the rest is the label's cross-entropy.",
)
@click.option(
    "--slot-weights",
    callback=lambda ctx, param, value: _floats(value, param),
    default="",
    show_default=False,
    help="The noisy loss's weight per mask slot 1..B, comma-separated (e.g. 1,1.5,2,2.5): each row's noisy "
    "loss keeps its total, the slots trade weight within it. Default: every slot alike.",
)
@click.option(
    "--consistency",
    type=Finite(min=0.0),
    default=T["consistency"],
    show_default=True,
    help="Weight of a consistency term at the mask positions: the noisy stream's last hidden state pulled to the "
    "clean stream's at the same position (relative squared error; the clean stream is the teacher).",
)
@click.option(
    "--gate",
    type=click.Choice(GATES),
    default=T["gate"],
    show_default=True,
    help="LoRA: masks = the adapter's deltas act at mask positions only, so every real token runs the base weights "
    "and threshold 1.0 / lossless output is exactly the base model's (recorded in mars.json; cannot be fused).",
)
@click.option(
    "--draft-corpus/--no-draft-corpus",
    default=F["draft_corpus"],
    show_default=True,
    help="Also write the training split's records as the checkpoint's draft_corpus.npz (at most 4M tokens), "
    "which lossless decoding drafts from (`mars corpus` builds one from other data).",
)
@click.option("--seed", type=int, default=T["seed"], show_default=True)
@device_options
@backend_option
@friendly_errors
def finetune_command(**opts):
    """Fine-tune a model with the MARS objective (noisy + ar_weight x clean cross-entropy)."""
    if click.get_current_context().get_parameter_source("block_size") != click.core.ParameterSource.COMMANDLINE:
        opts["block_size"] = None  # the init adapter's, else the default
    quiet_libraries()
    output = opts["output"]
    try:
        result = finetune(opts.pop("data"), opts.pop("output"), announce=say, **opts)
    except FinetuneError as e:
        raise click.BadParameter(
            as_flags(str(e)), param_hint=FLAGS.get(e.setting, "--" + e.setting.replace("_", "-"))
        ) from None
    except TrainingInterrupted as e:
        if e.saved is None:
            raise Interrupted(
                f"{e}, before the first checkpoint: nothing to resume; start again with: {rerun_command()}"
            ) from None
        raise Interrupted(
            f"{e}; the checkpoint of step {e.saved} is in {output / CHECKPOINT}; resume with: "
            f"{rerun_command(adding='--resume')}"
        ) from None
    if not result["main"]:
        return  # one process of several: rank 0 reports
    last = result["history"][-1] if result["history"] else {}
    summary = {k: round(v, 4) for k, v in last.items() if isinstance(v, float)}
    click.echo(
        f"saved {result['output']} after {result['steps']} steps in {result['seconds']:.0f}s {json.dumps(summary)}"
    )
