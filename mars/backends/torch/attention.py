"""Grouped-query attention without copying the keys, for masked multi-token forwards on the CPU.

transformers' `sdpa` attention lets torch's kernel share each key/value head among its
query heads (`enable_gqa`) only when no attention mask is given; with a mask (any
multi-token forward on a cache, any batch with holes) it first copies every cached key
and value once per query head of the group. On the CPU the kernel handles a mask with
`enable_gqa` as well, with bit-identical results, so the copy (which grows with the
cache) is pure overhead: `mars_sdpa` skips it there and is transformers' `sdpa`
everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "mars_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None and not kwargs.get("output_attentions")
    if groups > 1 and attention_mask is not None and query.device.type == "cpu" and plain:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)


def use_grouped_sdpa(model: torch.nn.Module) -> bool:
    """Switch a transformers model that runs `sdpa` to `mars_sdpa` (same masks, same results);
    returns whether it was switched."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError):
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME
