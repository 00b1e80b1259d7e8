"""Model cards (README.md) for what `mars convert` writes: a fused MARS model, a vLLM export."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..core.config import MarsConfig
from ..core.train.loop import TRAINING_LOG

_MARS_FIELDS = {
    "block_size": "masks per block (tokens a forward may add beyond the first)",
    "mask_token": "the mask token's text",
    "mask_token_id": "the mask token's id (its embedding row was trained)",
    "metric": "the confidence metric thresholds apply to",
    "default_mode": "how mars decodes when asked for no mode",
    "default_threshold": "the threshold mars decodes at when asked for none",
    "ar_weight": "weight of the clean-stream (AR) loss in training",
    "gate": "masks: the adapter acts at mask positions only; none: at every position",
}


def _front_matter(base: str | None, tags: list[str]) -> str:
    from .paths import portable_ref

    lines = ["---", "library_name: transformers"]
    if base and portable_ref(base):  # a local path names nothing on another machine
        lines.append(f"base_model: {base}")
    lines += ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]
    return "\n".join(lines)


def mars_table(mars: MarsConfig) -> str:
    rows = [f"| `{name}` | `{json.dumps(getattr(mars, name))}` | {meaning} |" for name, meaning in _MARS_FIELDS.items()]
    return "\n".join(["| mars.json | value | meaning |", "|---|---|---|", *rows])


def measured(source: Path) -> str:
    """The last training record of `source`'s training_log.jsonl as a sentence, or ''."""
    log = source / TRAINING_LOG
    if not log.is_file():
        return ""
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    if not lines:
        return ""
    last = json.loads(lines[-1])
    figures = [
        f"{key} {last[key]:.4f}"
        for key in ("noisy", "clean", "val_noisy", "val_clean")
        if isinstance(last.get(key), float)
    ]
    if not figures:
        return ""
    return (
        f"At the end of training (step {last.get('step', '?')}, from `{log.resolve()}`): cross-entropy "
        f"{', '.join(figures)} (noisy: the masks' predictions; clean: the ordinary next-token loss)."
    )


def fused_card(output: Path, *, base: str | None, adapter: Path, mars: MarsConfig | None, note: str = "") -> str:
    """README.md of a base model with a (MARS) LoRA adapter fused in by `mars convert --fuse`
    (or as a vLLM drafter): `output` is where the model will be read from, `mars` what its
    mars.json says, `note` a paragraph on what this particular model is for."""
    out = shlex.quote(str(output))
    name = output.name
    method = (
        "fine-tuned with the MARS objective (mask autoregression): the model learns to predict the tokens after the "
        f"next one from mask tokens placed after the text, so one forward pass can emit up to {mars.block_size + 1} "
        "tokens, while plain decoding works as before"
        if mars is not None
        else "fine-tuned with a LoRA adapter"
    )
    parts = [
        _front_matter(base, ["mars", "multi-token-prediction", "lora-fused"] if mars is not None else ["lora-fused"]),
        f"# {name}\n",
        f"{base or 'A base model'} {method}. The LoRA adapter `{adapter.name}` is fused into the weights"
        + (", with the trained mask-token row in the embedding." if mars is not None else "."),
        "",
    ]
    if note:
        parts += [note, ""]
    if mars is not None:
        parts += ["## What mars.json says\n", mars_table(mars), ""]
    figures = measured(adapter)
    if figures:
        parts += ["## Measured\n", figures, ""]
    parts += [
        "## Load it\n",
        "transformers (a plain causal LM; greedy decoding is ordinary one-token-per-forward decoding):\n",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"model = AutoModelForCausalLM.from_pretrained({str(output)!r})",
        f"tokenizer = AutoTokenizer.from_pretrained({str(output)!r})",
        "```\n",
        "mlx_lm (reads this directory as it is):\n",
        "```bash",
        f"python -m mlx_lm generate --model {out} --prompt 'Hello'",
        "```\n",
        "vLLM, as a plain model (`--dtype float32`: vLLM would load float32 weights as bfloat16; "
        "`VLLM_CPU_KVCACHE_SPACE` for its CPU build), or exported as a parallel drafter for speculative decoding:\n",
        "```bash",
        f"VLLM_CPU_KVCACHE_SPACE=2 python -m vllm.entrypoints.openai.api_server --model {out} --dtype float32",
        f"mars convert {out} --to vllm -o {shlex.quote(name + '-vllm')}",
        "```\n",
    ]
    if mars is not None:
        parts += [
            "mars, several tokens per forward (`--lossless` gives exactly the greedy output):\n",
            "```bash",
            f"mars chat --model {out}",
            f"mars generate --model {out} --lossless --prompt 'Hello'",
            "```\n",
        ]
    return "\n".join(parts)


def adapter_card(output: Path, source: Path) -> str:
    """README.md of a PEFT adapter converted from an mlx-lm one: the base model it fits. An adapter
    trained on an mlx-lm quantized model fits that model's dequantized weights, which transformers
    can read once `mars convert` has written them."""
    from ..core.config import has_config, read_config
    from .paths import mlx_quantization, portable_ref

    mars = read_config(source) if has_config(source) else None
    base = mars.base_model if mars is not None else ""
    out = shlex.quote(str(output))
    parts = [
        _front_matter(base, ["mars", "peft", "lora"] if mars is not None else ["peft", "lora"]),
        f"# {output.name}\n",
    ]
    what = "A MARS LoRA adapter (with its trained mask-token row)" if mars is not None else "A LoRA adapter"
    quant = mlx_quantization(Path(base)) if base and not portable_ref(base) else None
    if quant is not None:
        hf = shlex.quote(str(Path(base).with_name(Path(base).name + "-hf")))
        parts += [
            f"{what}, converted from mlx-lm's format by `mars convert`. It was trained on `{base}`, an mlx-lm "
            f"{quant['bits']}-bit model (groups of {quant.get('group_size', '?')}): it fits that model's dequantized "
            f"weights, "
            "which is what a float model made from it holds. For transformers and peft, write them once:\n",
            "```bash",
            f"mars convert {shlex.quote(base)} --to hf --output {hf}",
            f"mars generate --backend torch --model {hf} --adapter-path {out} --prompt 'Hello'",
            "```\n",
            f"On MLX it runs on the quantized model itself: `mars generate --backend mlx --model {shlex.quote(base)} "
            f"--adapter-path {out}`.",
            "",
        ]
    else:
        parts += [
            f"{what}, converted from mlx-lm's format by `mars convert`, "
            f"for the base model `{base or 'it was trained on'}`.",
            "",
        ]
    if mars is not None:
        parts += ["## What mars.json says\n", mars_table(mars), ""]
    figures = measured(source)
    if figures:
        parts += ["## Measured\n", figures, ""]
    return "\n".join(parts)
