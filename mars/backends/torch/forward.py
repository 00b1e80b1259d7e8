"""What a forward through a transformers causal LM needs, in training and in decoding: its body
and its head (with the model's own final logits), its sliding windows, and the additive
attention masks it takes for the core's bool masks."""

from __future__ import annotations

import numpy as np
import torch

from ...checkpoint.hf_config import position_gaps, sliding_windows
from ...checkpoint.paths import ModelError


def additive_mask(mask: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    """Bool (b, q, kv) -> additive float (b, 1, q, kv): 0 where allowed, the dtype's minimum elsewhere.

    A float mask means the same thing to every attention implementation (eager adds
    a boolean mask as 0/1 instead of masking).
    """
    allowed = torch.from_numpy(np.ascontiguousarray(mask)).to(device)
    out = torch.zeros(allowed.shape, dtype=dtype, device=device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[:, None]


def model_windows(model: torch.nn.Module) -> list[int | None]:
    """Per layer, the sliding window the model applies, or None (mars.checkpoint.hf_config)."""
    return sliding_windows(body_and_head(model)[0].config.to_dict())


def attention_masks(mask: np.ndarray, query_positions: np.ndarray, key_positions: np.ndarray, windows, dtype, device):
    """The `attention_mask` a transformers body takes for the bool `mask` (b, q, kv): one
    additive mask for every layer, or one per layer type when some layers slide.

    A transformers model given a 4D mask applies it as it is, its sliding windows included:
    so a sliding layer gets `mask` cut to the window here, by logical position (a query at
    position p keeps the keys at p - W + 1 .. p), the same cut for a real token and a mask,
    in training and in decoding. Where no query is W positions past a key, the window
    changes nothing and the one mask serves every layer."""
    full = additive_mask(mask, dtype, device)
    sizes = {w for w in windows if w}
    if not sizes:
        return full
    if len(sizes) > 1:
        raise ModelError(f"layers with different sliding windows ({sorted(sizes)}) are not supported")
    window = sizes.pop()
    gap = position_gaps(query_positions, key_positions)
    if not (mask & (gap >= window)).any():
        return full
    sliding = additive_mask(mask & (gap < window), dtype, device)
    if None not in windows:
        return sliding
    return {"full_attention": full, "sliding_attention": sliding}


def window_cut(mask: np.ndarray, query_positions: np.ndarray, key_positions: np.ndarray, windows):
    """(the bool `mask`, the same cut to the layers' sliding window by logical position), as
    attention_masks cuts it, for a forward that builds its additive masks itself."""
    sizes = {w for w in windows if w}
    if len(sizes) > 1:
        raise ModelError(f"layers with different sliding windows ({sorted(sizes)}) are not supported")
    if not sizes:
        return mask, mask
    gap = position_gaps(query_positions, key_positions)
    return mask, mask & (gap < sizes.pop())


def body_and_head(model: torch.nn.Module):
    """The decoder body and the LM head of a *ForCausalLM, through a PEFT wrapper if any
    (LoRA layers live inside the body, so calling it uses them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    config = base.config
    scaling, softcap = getattr(config, "logits_scaling", None), getattr(config, "final_logit_softcapping", None)
    if (scaling not in (None, 1.0) or softcap) and not isinstance(head, FinalLogits):
        head = FinalLogits(head, scaling or 1.0, softcap)
    return getattr(base, base.base_model_prefix), head


class FinalLogits(torch.nn.Module):
    """An LM head followed by what the model's own forward does to its logits: Granite divides
    them by `logits_scaling`, Gemma soft-caps them (`final_logit_softcapping`). Confidences are
    read off these logits, so they must be the model's."""

    def __init__(self, head: torch.nn.Module, scaling: float, softcap: float | None):
        super().__init__()
        self.head, self.scaling, self.softcap = head, scaling, softcap

    @property
    def weight(self):
        return self.head.weight

    def forward(self, hidden):
        return self.finish(self.head(hidden))

    def finish(self, logits):
        """What the model does to the head's output."""
        if self.scaling != 1.0:
            logits = logits / self.scaling
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
