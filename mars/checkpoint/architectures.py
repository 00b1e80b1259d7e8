"""The architecture table: which transformers `model_type`s each part of mars runs, as tested
by tests/test_architectures.py, and the one-line refusal for the others."""

from __future__ import annotations

import json
from pathlib import Path

# The MLX backend: decoding exact against greedy AR and the torch backend, the MARS mask the
# model's own attention. mlx-lm has no model for Ministral (its `ministral3` is another).
MLX = tuple("llama qwen2 qwen3 mistral gemma3_text phi3 olmo2 granite smollm3 qwen3_moe mixtral".split())
TORCH = MLX + ("ministral",)
# The torch decoder's path per architecture: these decode on mars's own forward
# (mars/backends/torch/models/, one file each), the rest of TORCH through transformers' modules
# steered by the decoder (mars/backends/torch/decode.py). Training runs transformers' modules for all.
TORCH_OWN_FORWARD = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "granite")
# `mars convert` HF <-> MLX (and --to vllm), for what mlx-lm reads; a mixture of experts'
# per-expert tensors are stacked for mlx-lm.
CONVERT = MLX
# LoRA targets beside mars.core.train.loop.LORA_TARGETS: Phi-3's fused projections.
FUSED_LORA_TARGETS = ("qkv_proj", "gate_up_proj")


def model_type(directory: Path) -> str | None:
    """config.json's model_type of a model directory (None where there is no readable one)."""
    try:
        return json.loads((Path(directory) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def refusal(arch: str, where, part: str) -> str | None:
    """The one-line error for a model of architecture `arch` (read from `where`: its config.json
    or GGUF file) in `part` ("torch", "mlx" or "convert"), naming the table and the closest
    path; None if it runs there."""
    table = {"torch": TORCH, "mlx": MLX, "convert": CONVERT}[part]
    if arch in table:
        return None
    name = {"torch": "the torch backend", "mlx": "the MLX backend", "convert": "mars convert"}[part]
    closest = ""
    if part == "mlx" and arch in TORCH:
        closest = f"; architecture '{arch}' runs on the torch backend only: use --backend torch"
    elif part != "torch" and arch not in TORCH:
        closest = "; no backend runs it"
    return f"{where}: architecture '{arch}' is not supported by {name} (supported: {', '.join(table)}){closest}"
