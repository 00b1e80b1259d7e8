"""Gated LoRA on MLX (`--gate masks`): the adapter's deltas act at mask positions only.

The same rule as the torch backend (mars/backends/torch/gate.py): every mlx-lm `LoRALinear`
of the model becomes a `GatedLoRALinear`, whose low-rank term is multiplied by a gate set
from the input ids before each forward (1 at the mask token, 0 elsewhere), so real tokens
run the frozen base weights exactly.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.tuner.lora import LoRALinear


class GatedLoRALinear(LoRALinear):
    def __call__(self, x):
        y = self.linear(x)
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        gate = self._mars_gate.value
        z = z * gate.astype(z.dtype) if gate is not None else mx.zeros_like(z)
        return y + (self.scale * z).astype(x.dtype)


class MlxMaskGate:
    """Gates every LoRA layer of `model`; call `set(input_ids)` before each forward."""

    def __init__(self, model, mask_id: int):
        self.mask_id = mask_id
        self.value = None
        count = 0
        for _, layer in model.named_modules():
            if isinstance(layer, LoRALinear):
                layer.__class__ = GatedLoRALinear
                object.__setattr__(layer, "_mars_gate", self)
                count += 1
        if not count:
            raise ValueError("gate masks: the model has no LoRA layers to gate")

    def set(self, input_ids: mx.array) -> None:
        self.value = (input_ids == self.mask_id)[..., None]
