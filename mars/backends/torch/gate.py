"""Gated LoRA (`--gate masks`): the adapter's deltas act at mask positions only.

Every real token then runs the frozen base weights: the clean stream of training is the
base model, and so is threshold-1.0 and lossless decoding, so a gated adapter cannot move
the model's own answers; only the masks' guesses learn. A forward hook on each LoRA `B`
projection multiplies its output by the gate, 1 where the input id is the mask token and 0
elsewhere, so the delta is exactly zero at real tokens. Such an adapter cannot be fused
into the base weights (they act at every position); it is loaded unmerged.

Loaded for decoding, the PEFT layers give way to `GatedLoRALinear` (`unwrap_for_decoding`):
the delta is computed at the mask positions only, and a forward that feeds no mask runs the
base layers alone, as fast as the plain base. Training keeps PEFT and the hooks (`MaskGate`).
"""

from __future__ import annotations

import numpy as np
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

    def set_host(self, input_ids: np.ndarray, device) -> None:
        """`set` from the host's copy of the ids (as DecodeGate.set_host)."""
        self.value = torch.from_numpy(np.asarray(input_ids) == self.mask_id)[..., None].to(device)

    def clear(self) -> None:
        self.value = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class DecodeGate:
    """The gate of a gated adapter loaded for decoding (`unwrap_for_decoding`): call
    `set(input_ids)` before each forward; unset (or after `clear`) every position runs the
    base weights alone."""

    def __init__(self, mask_id: int, dtype: torch.dtype = torch.float32):
        self.mask_id = mask_id
        self.dtype = dtype
        self.column: torch.Tensor | None = None  # 1.0 at mask positions, 0.0 elsewhere; None if no mask is fed
        self.rows: slice | None = None  # the mask positions when they are one run of consecutive positions

    def set(self, input_ids: torch.Tensor) -> None:
        is_mask = (input_ids == self.mask_id).reshape(-1)
        self._place(torch.nonzero(is_mask).reshape(-1).tolist(), lambda: is_mask.to(self.dtype).reshape(-1, 1))

    def set_host(self, input_ids: np.ndarray, device) -> None:
        """`set` from the host's copy of the ids: where the masks are is read on the host, so
        the step makes no device-to-host copy for it."""
        is_mask = (np.asarray(input_ids) == self.mask_id).reshape(-1)
        self._place(
            np.flatnonzero(is_mask).tolist(),
            lambda: torch.from_numpy(is_mask.astype(np.float32)).to(device=device, dtype=self.dtype).reshape(-1, 1),
        )

    def _place(self, where: list[int], column) -> None:
        if not where:
            self.column, self.rows = None, None
            return
        self.column = column()
        first, last = where[0], where[-1]
        # One run (a batch-1 step: its masks and spare groups end the row): the delta is
        # computed on those rows alone, and the real tokens' outputs are not touched at all.
        self.rows = slice(first, last + 1) if last - first + 1 == len(where) else None

    def clear(self) -> None:
        self.column, self.rows = None, None


class GatedLoRALinear(torch.nn.Module):
    """A gated LoRA layer in its decoding form: the base layer at every position, plus the
    low-rank delta where the gate is 1. A forward without masks (plain AR, a step that only
    verifies drafts) runs exactly the base layer, with no adapter work at all; with masks
    the delta is two or three small operations (on a CPU each costs more in overhead than
    in arithmetic): on the masks' rows alone when they are one run (batch 1), else on every
    row times the gate column, which adds an exact 0.0 at every real token."""

    def __init__(self, base: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: float, gate: DecodeGate):
        super().__init__()
        self.base = base
        dtype = base.weight.dtype
        self.register_buffer("lora_a_t", a.detach().t().contiguous().to(dtype))
        self.register_buffer("lora_b_t", (b.detach() * scale).t().contiguous().to(dtype))  # the scale folded in once
        object.__setattr__(self, "_gate", gate)  # shared by every layer, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        column = self._gate.column
        if column is None:
            return y
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] != column.shape[0]:
            raise RuntimeError(
                f"gated adapter: the gate was set for {column.shape[0]} positions, the input has {flat.shape[0]}"
            )
        out = y.reshape(-1, y.shape[-1])  # a view when y is contiguous, else a copy: return it either way
        rows = self._gate.rows
        if rows is not None:
            out[rows].addmm_(torch.mm(flat[rows], self.lora_a_t), self.lora_b_t)
            return out.view(y.shape)
        low = torch.mm(flat, self.lora_a_t).mul_(column)
        return out.addmm_(low, self.lora_b_t).view(y.shape)


def unwrap_for_decoding(model: torch.nn.Module, mask_id: int) -> tuple[torch.nn.Module, DecodeGate]:
    """A PEFT model with a gated LoRA adapter -> the plain transformers model with each LoRA
    layer replaced by its `GatedLoRALinear`, and their shared gate. For inference only (the
    LoRA weights become buffers): training keeps the PEFT model and `MaskGate`."""
    from peft.tuners.lora import LoraLayer

    gate = None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, module in list(base.named_modules()):
        if not isinstance(module, LoraLayer):
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if (
            len(adapters) != 1
            or getattr(module, "lora_variant", {})
            or not isinstance(module.base_layer, torch.nn.Linear)
        ):
            raise GateError(f"gate masks: {name}: only one plain LoRA adapter on linear layers can be gated")
        a = adapters[0]
        gate = gate or DecodeGate(mask_id, module.base_layer.weight.dtype)
        layer = GatedLoRALinear(
            module.base_layer, module.lora_A[a].weight, module.lora_B[a].weight, module.scaling[a], gate
        )
        parent, _, child = name.rpartition(".")
        setattr(base.get_submodule(parent) if parent else base, child, layer)
    if gate is None:
        raise GateError("gate masks: the model has no LoRA layers to gate")
    return base, gate
