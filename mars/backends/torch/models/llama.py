"""Llama (SmolLM2 and the checkpoints built like it): the common arguments, nothing added."""

from .base import common_args


def model_args(config, body, windows):
    return common_args(config, body, windows)
