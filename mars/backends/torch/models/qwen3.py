"""Qwen3: Llama's layers with an RMSNorm over each head of the queries and keys, before RoPE."""

from .base import common_args


def model_args(config, body, windows):
    return common_args(config, body, windows, qk_norm=True)
