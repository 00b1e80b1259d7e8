"""Qwen2: Llama's layers with a bias on the query, key and value projections (the layers carry
it); sliding layers where the config turns them on (the masks cut them)."""

from .base import common_args


def model_args(config, body, windows):
    return common_args(config, body, windows)
