"""SmolLM3: Llama's layers, some without RoPE (config.no_rope_layers: 1 applies it, 0 does not)."""

from .base import common_args


def model_args(config, body, windows):
    rope = tuple(bool(x) for x in config.no_rope_layers)
    return common_args(config, body, windows, rope_layers=rope)
