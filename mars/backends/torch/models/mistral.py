"""Mistral: Llama's layers; a sliding window on every layer where the config sets one (the masks cut it)."""

from .base import common_args


def model_args(config, body, windows):
    return common_args(config, body, windows)
