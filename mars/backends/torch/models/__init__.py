"""mars's own decoder forward (base.Transformer), one file per family of checkpoints: which
transformers model types run on it, and building it over a loaded model's weights. The other
architectures of the table (mars.checkpoint.architectures) decode through transformers' modules
(mars.backends.torch.decode), as `lean_family` says."""

from __future__ import annotations

import importlib

from ....checkpoint.architectures import TORCH_OWN_FORWARD
from .base import KVCache, ModelArgs, StepInputs, Transformer, inference, room_layout
from .compiled import CompiledStep, graph_width

# model_type -> the module (in this folder) whose model_args reads its checkpoints: the table's
# TORCH_OWN_FORWARD, each a file named after it.
FAMILIES = {arch: arch for arch in TORCH_OWN_FORWARD}
# RoPE variants whose frequencies change with the sequence's length: transformers' modules keep them.
_DYNAMIC_ROPE = ("dynamic", "longrope")


def lean_family(config) -> str | None:
    """The family file that runs a checkpoint of this config on mars's own forward, or None (its
    architecture, or a RoPE that depends on the length, runs through transformers' modules)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if family is None or (isinstance(rope, dict) and rope.get("rope_type") in _DYNAMIC_ROPE):
        return None
    return family


def build(body, head, windows) -> Transformer | None:
    """mars's forward over a transformers body and head (the checkpoint's tensors, shared, not
    copied; a gated adapter's layers as unwrap_for_decoding left them), or None where the
    architecture keeps transformers' modules."""
    family = lean_family(body.config)
    if family is None:
        return None
    module = importlib.import_module(f"{__name__}.{family}")
    return Transformer(body, head, module.model_args(body.config, body, windows))


__all__ = [
    "FAMILIES",
    "CompiledStep",
    "KVCache",
    "ModelArgs",
    "StepInputs",
    "Transformer",
    "build",
    "graph_width",
    "inference",
    "lean_family",
    "room_layout",
]
