"""The architecture table: which transformers `model_type`s each part of mars runs, as tested
by tests/test_architectures.py, and the one-line refusal for the others."""

from __future__ import annotations

import json
from pathlib import Path

# Both backends: decoding exact against greedy AR, the MARS mask the model's own attention.
TORCH = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "olmo2", "granite", "smollm3", "qwen3_moe", "mixtral")
MLX = TORCH
# `mars convert` HF <-> MLX (and --to vllm); a mixture of experts' per-expert tensors are stacked for mlx-lm.
CONVERT = TORCH


def model_type(directory: Path) -> str | None:
    """config.json's model_type of a model directory (None where there is no readable one)."""
    try:
        return json.loads((Path(directory) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def refusal(arch: str, where, part: str) -> str | None:
    """The one-line error for `arch` in `part` ("torch", "mlx" or "convert"), or None if it runs there."""
    table = {"torch": TORCH, "mlx": MLX, "convert": CONVERT}[part]
    if arch in table:
        return None
    name = {"torch": "the torch backend", "mlx": "the MLX backend", "convert": "mars convert"}[part]
    closest = ""
    if part == "mlx" and arch in TORCH:
        closest = f"; architecture '{arch}' runs on the torch backend only: use --backend torch"
    elif part == "convert" and arch in TORCH:
        closest = f"; both backends load its Hugging Face directory as it is (--model {where})"
    return f"{where}: architecture '{arch}' is not supported by {name} (supported: {', '.join(table)}){closest}"
