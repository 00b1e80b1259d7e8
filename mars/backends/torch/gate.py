"""Gated LoRA (`--gate masks`): the adapter's deltas act at mask positions only.

Every real token then runs the frozen base weights: the clean stream of training is the
base model, and so is threshold-1.0 and lossless decoding, so a gated adapter cannot move
the model's own answers; only the masks' guesses learn. A forward hook on each LoRA `B`
projection multiplies its output by the gate, 1 where the input id is the mask token and 0
elsewhere, so the delta is exactly zero at real tokens. Such an adapter cannot be fused
into the base weights (they act at every position); it is loaded unmerged.
"""

from __future__ import annotations

import torch


class GateError(ValueError):
    """A gated adapter used where only an ungated one works (fusing, full fine-tuning)."""


class MaskGate:
    """Gates every LoRA layer of `model` (a PEFT model) by `input_ids == mask_id`; call
    `set(input_ids)` before each forward. Unset (or after `clear`) the deltas are zero."""

    def __init__(self, model: torch.nn.Module, mask_id: int):
        self.mask_id = mask_id
        self.value: torch.Tensor | None = None
        self.handles = []
        for module in model.modules():
            lora_b = getattr(module, "lora_B", None)
            if isinstance(lora_b, torch.nn.ModuleDict):
                for layer in lora_b.values():
                    self.handles.append(layer.register_forward_hook(self._hook))
        if not self.handles:
            raise GateError("gate masks: the model has no LoRA layers to gate")

    def _hook(self, module, args, out):
        if self.value is None:
            return torch.zeros_like(out)
        return out * self.value.to(out.dtype)

    def set(self, input_ids: torch.Tensor) -> None:
        self.value = (input_ids == self.mask_id)[..., None]

    def clear(self) -> None:
        self.value = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
