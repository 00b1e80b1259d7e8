"""The MARS training forward and loss on the MLX backend (docs/method.md §4): mars_losses, the
arrays it takes (loss_inputs), and the losses that mars eval reports."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .forward import embed_tokens, head, hidden_states
from .load import MlxModel


def distill_kl(student: mx.array, teacher: mx.array, temperature: float) -> mx.array:
    """Per row: T^2 KL(softmax(teacher / T) || softmax(student / T)), the teacher held fixed."""
    t = temperature
    teacher = mx.stop_gradient(teacher)
    log_p = teacher / t - mx.logsumexp(teacher / t, axis=-1, keepdims=True)
    log_q = student / t - mx.logsumexp(student / t, axis=-1, keepdims=True)
    return (mx.exp(log_p) * (log_p - log_q)).sum(-1) * t * t


def mars_losses(
    model: nn.Module, batch: dict, mask_row=None, mask_id: int = -1, gate=None, distill=None, consistency: float = 0.0
):
    """(noisy, clean) losses of a MARS batch (docs/method.md §4), from the arrays of `loss_inputs`;
    `gate`: a gated adapter's MlxMaskGate (the deltas act at mask positions only); the batch's
    "noisy_weights" (slot weights) weigh the noisy stream's targets when present; `consistency`:
    see core.train.loop.TrainSettings (the torch MarsLoss's term, the same numbers)."""
    inputs = batch["input_ids"]
    if gate is not None:
        gate.set(inputs)
    start = batch.get("start", 0)
    length = (inputs.shape[1] + start) // 2
    embeddings = None
    if mask_row is not None:
        # Under LoRA the embedding matrix is frozen; the mask token's row is its own parameter.
        embeddings = embed_tokens(model)(inputs)
        embeddings = mx.where((inputs == mask_id)[..., None], mask_row.astype(embeddings.dtype), embeddings)
    h = hidden_states(model, inputs, [(length - start, start), (length, 0)], batch["mask"], embeddings=embeddings)
    rows = mx.concatenate([batch["rows"], batch["rows"]])
    index = mx.concatenate([batch["noisy_index"], batch["clean_index"]])
    states = h[rows, index]
    logits = head(model, states).astype(mx.float32)
    targets = mx.concatenate([batch["targets"], batch["targets"]])
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    n = batch["targets"].shape[0]
    w = batch["weights"]
    per_token = ce[:n]
    if distill is not None:  # (temperature, mix): the noisy stream learns the clean stream's distribution
        temperature, mix = distill
        kl = distill_kl(logits[:n], logits[n:], temperature)
        per_token = kl if mix >= 1.0 else (1.0 - mix) * per_token + mix * kl
    if consistency:
        student, teacher = states[:n].astype(mx.float32), mx.stop_gradient(states[n:].astype(mx.float32))
        distance = ((student - teacher) ** 2).sum(-1) / mx.maximum((teacher**2).sum(-1), 1e-12)
        per_token = per_token + consistency * distance
    return (per_token * batch.get("noisy_weights", w)).sum(), (ce[n:] * w).sum()


def loss_inputs(
    ids, labels, lengths, block_size: int, mask_id: int, normalize: str = "row", trim: bool = True, slot_weights=()
) -> dict:
    """MLX arrays for `mars_losses` from a padded numpy batch; masks and alignment come from the core.
    trim: leave out the noisy blocks no loss reads (masks.noisy_start); the losses are the same.
    slot_weights: the noisy loss's weight per mask slot (core.loss.align)."""
    from ...core.loss import align
    from ...core.masks import noisy_start, training_inputs

    start = noisy_start(labels, block_size) if trim else 0
    input_ids, _, mask = training_inputs(ids, labels, lengths, block_size, mask_id, start=start)
    al = align(labels, normalize, start, block_size, slot_weights)
    return {
        "start": start,  # where the noisy stream begins (a plain int: positions, not data)
        "input_ids": mx.array(input_ids.astype(np.int32)),
        "mask": mx.array(mask)[:, None],
        "rows": mx.array(al.rows.astype(np.int32)),
        "noisy_index": mx.array(al.noisy_index.astype(np.int32)),
        "clean_index": mx.array(al.clean_index.astype(np.int32)),
        "targets": mx.array(al.targets.astype(np.int32)),
        "weights": mx.array(al.weights),
        **({"noisy_weights": mx.array(al.noisy_weights)} if al.noisy_weights is not al.weights else {}),
    }


def losses(loaded: MlxModel):
    """`step(ids, labels, lengths, block_size, mask_id) -> (noisy, clean)`: the mean losses per
    labelled token of a padded batch, through the training forward and loss (mars eval's NLL)."""

    def step(ids, labels, lengths, block_size, mask_id):
        inputs = loss_inputs(ids, labels, lengths, block_size, mask_id, normalize="token")
        noisy, clean = mars_losses(loaded.model, inputs, gate=loaded.gate)
        mx.eval(noisy, clean)
        return float(noisy.item()), float(clean.item())

    return step
