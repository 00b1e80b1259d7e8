"""The MARS training forward and loss on the torch backend (docs/method.md §4): MarsLoss, the
tensors it takes (loss_inputs), and the losses without gradients that mars eval reports."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...core.loss import Alignment
from .cache import cache_argument
from .forward import attention_masks, body_and_head, model_windows
from .load import TorchModel


def _mask_part(attn, rows: slice, columns):
    """Rows and columns (a slice, or a list of slices joined) of an attention argument."""
    if isinstance(attn, dict):
        return {kind: _mask_part(a, rows, columns) for kind, a in attn.items()}
    if isinstance(columns, slice):
        return attn[:, :, rows, columns]
    return torch.cat([attn[:, :, rows, c] for c in columns], dim=-1)


class MarsLoss(torch.nn.Module):
    """The MARS objective (docs/method.md §4) around a causal LM; a module so DDP/accelerate can wrap it."""

    def __init__(
        self,
        model: torch.nn.Module,
        mask_row: torch.nn.Parameter | None = None,
        mask_id: int = -1,
        gate=None,
        distill: tuple[float, float] | None = None,
    ):
        super().__init__()
        self.model = model
        self.mask_row = mask_row
        self.mask_id = mask_id
        self.gate = gate  # gated LoRA: the deltas act at mask positions only
        self.distill = distill  # (temperature, mix): the noisy stream learns the clean stream's distribution
        self.split = True  # gated: the clean stream in a pass of its own, without gradients (gated_hidden)
        self.body, self.head = body_and_head(model)

    def embed(self, input_ids):
        table = self.body.get_input_embeddings()
        embeds = table(input_ids)
        if self.mask_row is None:
            return embeds
        # Under LoRA the embedding matrix is frozen; the mask token's row is its own parameter,
        # scaled as the embedding scales its rows (Gemma's sqrt(hidden)), as it will be once saved.
        row = self.mask_row.to(embeds.dtype)
        scale = getattr(table, "embed_scale", None)
        if scale is not None:
            row = row * (scale.to(table.weight.dtype) if torch.is_tensor(scale) else scale)
        is_mask = (input_ids == self.mask_id)[..., None]
        return torch.where(is_mask, row, embeds)

    def gated_hidden(self, input_ids, positions, attn):
        """The hidden states of a gated adapter's batch in two passes. The clean stream runs
        the base weights alone (the gate is 0 on every real token) and no loss term trains
        anything through it, so it runs without gradients, its keys kept in a cache; then
        the noisy stream runs with gradients on top of that cache, under its rows of the
        same mask. The same numbers as one joint forward, without the clean stream's backward."""
        from .cache import full_cache

        clean = int(positions[0, -1]) + 1  # the clean stream's positions are 0 .. L-1
        n = input_ids.shape[1] - clean
        cache = full_cache(self.body.config)
        with torch.no_grad():
            self.gate.set(input_ids[:, n:])
            out_c = self.body(
                inputs_embeds=self.embed(input_ids[:, n:]),
                position_ids=positions[:, n:],
                attention_mask=_mask_part(attn, slice(n, None), slice(n, None)),
                use_cache=True,
                **cache_argument(self.body, cache),
            )
        self.gate.set(input_ids[:, :n])
        # keys: the cached clean stream, then the noisy
        mask = _mask_part(attn, slice(None, n), [slice(n, None), slice(None, n)])
        out_n = self.body(
            inputs_embeds=self.embed(input_ids[:, :n]),
            position_ids=positions[:, :n],
            attention_mask=mask,
            use_cache=True,
            **cache_argument(self.body, cache),
        )
        return torch.cat([out_n.last_hidden_state, out_c.last_hidden_state], dim=1)

    def hidden(self, input_ids, positions, attn):
        if self.gate is not None and self.split:
            return self.gated_hidden(input_ids, positions, attn)
        if self.gate is not None:
            self.gate.set(input_ids)
        if self.mask_row is None:
            out = self.body(input_ids=input_ids, position_ids=positions, attention_mask=attn, use_cache=False)
        else:
            out = self.body(
                inputs_embeds=self.embed(input_ids), position_ids=positions, attention_mask=attn, use_cache=False
            )
        return out.last_hidden_state

    def forward(
        self,
        input_ids,
        positions,
        attn,
        rows,
        noisy_index,
        clean_index,
        targets,
        weights,
        noisy_weights=None,
        consistency: float = 0.0,
    ):
        """(noisy, clean) losses; `noisy_weights` (default `weights`) weigh the noisy stream's
        targets (slot weights, core.loss.align); `consistency` adds that weight times the
        noisy last hidden state's squared distance to the clean one's (detached), relative to
        the clean state's squared norm, to each noisy target's loss."""
        hidden = self.hidden(input_ids, positions, attn)
        index = torch.cat([noisy_index, clean_index])
        states = hidden[torch.cat([rows, rows]), index]
        logits = self.head(states).float()
        ce = F.cross_entropy(logits, torch.cat([targets, targets]), reduction="none")
        n = targets.shape[0]
        per_token = ce[:n]
        if self.distill is not None:
            per_token = mix_distill(per_token, logits[:n], logits[n:], *self.distill)
        if consistency:
            per_token = per_token + consistency * relative_distance(states[:n].float(), states[n:].float())
        noisy = (per_token * (weights if noisy_weights is None else noisy_weights)).sum()
        clean = (ce[n:] * weights).sum()
        return noisy, clean


def relative_distance(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per row: |student - teacher|^2 / |teacher|^2, the teacher detached."""
    teacher = teacher.detach()
    return ((student - teacher) ** 2).sum(-1) / (teacher**2).sum(-1).clamp_min(1e-12)


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per row: T^2 KL(softmax(teacher / T) || softmax(student / T)), the teacher detached."""
    t = temperature
    p = torch.softmax(teacher.detach() / t, dim=-1)
    log_ratio = torch.log_softmax(teacher.detach() / t, dim=-1) - torch.log_softmax(student / t, dim=-1)
    return (p * log_ratio).sum(-1) * t * t


def mix_distill(
    ce: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor, temperature: float, mix: float
) -> torch.Tensor:
    """(1 - mix) CE(label) + mix KL(clean stream || noisy stream), per noisy token."""
    kl = distill_kl(student, teacher, temperature)
    return kl if mix >= 1.0 else (1.0 - mix) * ce + mix * kl


def loss_inputs(
    ids,
    labels,
    lengths,
    block_size: int,
    mask_id: int,
    dtype,
    device,
    normalize="row",
    trim=True,
    windows=(),
    slot_weights=(),
):
    """Tensors for MarsLoss.forward from a padded numpy batch (the core builds masks and alignment).
    trim: leave out the noisy blocks no loss reads (masks.noisy_start); the losses are the same.
    windows: the model's sliding windows per layer (model_windows), cut into the mask by position.
    slot_weights: the noisy loss's weight per mask slot (core.loss.align)."""
    from ...core.loss import align
    from ...core.masks import noisy_start, training_inputs

    start = noisy_start(labels, block_size) if trim else 0
    input_ids, positions, mask = training_inputs(ids, labels, lengths, block_size, mask_id, start=start)
    al: Alignment = align(labels, normalize, start, block_size, slot_weights)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return dict(
        input_ids=t(input_ids),
        positions=t(positions),
        attn=attention_masks(mask, positions, positions, windows, dtype, device),
        rows=t(al.rows),
        noisy_index=t(al.noisy_index),
        clean_index=t(al.clean_index),
        targets=t(al.targets),
        weights=t(al.weights),
        **({"noisy_weights": t(al.noisy_weights)} if al.noisy_weights is not al.weights else {}),
    )


def losses(tm: TorchModel):
    """`step(ids, labels, lengths, block_size, mask_id) -> (noisy, clean)`: the mean losses per
    labelled token of a padded batch, through the training forward and loss without gradients
    (mars eval's NLL)."""
    module = MarsLoss(tm.model, gate=tm.gate)  # a gated adapter's deltas act at mask positions only
    windows = model_windows(tm.model)

    @torch.inference_mode()
    def step(ids, labels, lengths, block_size, mask_id):
        inputs = loss_inputs(
            ids, labels, lengths, block_size, mask_id, tm.dtype, tm.device, normalize="token", windows=windows
        )
        noisy, clean = module(**inputs)
        return float(noisy), float(clean)

    return step
