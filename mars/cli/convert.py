"""`mars convert`: models and adapters between the Hugging Face and mlx-lm layouts (mars.convert)."""

from __future__ import annotations

from pathlib import Path

import click

from .common import friendly_errors, say


@click.command("convert")
@click.argument("src", type=click.Path(path_type=Path))
@click.option(
    "--to",
    "to",
    type=click.Choice(["hf", "mlx", "vllm"]),
    required=True,
    help="Output format: Hugging Face (transformers / PEFT), mlx-lm, or vllm: a MARS checkpoint as a vLLM "
    "parallel drafter, with its target, speculative_config.json and a README with the commands.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    required=True,
    help="The directory to write (a new or empty one, unless --overwrite).",
)
@click.option(
    "--overwrite", is_flag=True, help="Replace an existing --output (atomically, once the conversion has succeeded)."
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default=None,
    help="Cast float tensors (default: keep each tensor's type).",
)
@click.option("-q", "--quantize", "quantize", is_flag=True, help="Quantize to mlx-lm affine layers (--to mlx).")
@click.option(
    "--q-bits",
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    default="4",
    show_default=True,
    help="Bits per weight (-q).",
)
@click.option(
    "--q-group-size",
    type=click.Choice(["32", "64", "128"]),
    default="64",
    show_default=True,
    help="Weights per scale and bias (-q).",
)
@click.option(
    "--adapter",
    "adapter",
    type=click.Path(path_type=Path),
    default=None,
    help="A LoRA adapter (PEFT or mlx-lm) to fuse into SRC; needs --fuse.",
)
@click.option("--fuse", is_flag=True, help="Write SRC with --adapter fused in as one full model.")
@click.option(
    "--model",
    "base",
    type=click.Path(path_type=Path),
    default=None,
    help="Adapter SRC: the base model, to place a PEFT adapter's layers for mlx-lm.",
)
@friendly_errors
def convert_command(src, to, output, overwrite, dtype, quantize, q_bits, q_group_size, adapter, fuse, base):
    """Convert a model (HF / mlx-lm directory, or .gguf) or a LoRA adapter (PEFT <-> mlx-lm) into --to's format.

    SRC and --model may also be default:SmolLM2-135M-Instruct, the embedded default model."""
    from ..checkpoint.default_model import DEFAULT_REF, default_model_dir
    from ..convert import ConvertError, adapter_format, convert_adapter, convert_model, convert_vllm

    src, base = (default_model_dir(announce=say) if p is not None and str(p) == DEFAULT_REF else p for p in (src, base))
    if to == "vllm":
        if adapter is not None or fuse or quantize or dtype or base is not None:
            raise ConvertError(
                "--to vllm exports a MARS checkpoint as it is; --adapter, --fuse, --model, --dtype and -q do not apply"
            )
        click.echo(f"wrote {convert_vllm(src, output, overwrite=overwrite, announce=say)}")
        return
    if adapter is not None and not fuse:
        raise ConvertError(
            "--adapter fuses an adapter into SRC; add --fuse (or give the adapter directory as SRC to convert it)"
        )
    if fuse and adapter is None:
        raise ConvertError("--fuse needs --adapter ADAPTER_DIR")
    if adapter_format(src) is not None:
        if quantize or dtype or fuse:
            raise ConvertError(f"{src}: an adapter converts as it is; --dtype, -q and --fuse apply to models")
        out = convert_adapter(src, output, to, base=base, overwrite=overwrite)
    else:
        out = convert_model(
            src,
            output,
            to,
            dtype=dtype,
            q_bits=int(q_bits) if quantize else None,
            q_group_size=int(q_group_size),
            adapter=adapter,
            overwrite=overwrite,
            announce=say,
        )
    click.echo(f"wrote {out}")
