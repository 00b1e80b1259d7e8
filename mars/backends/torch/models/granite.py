"""Granite: Llama's layers with multipliers: the embeddings (embedding_multiplier), each block's
outputs before the residual (residual_multiplier), the attention's scale (attention_multiplier,
which the attention module holds as its scaling); the head's logits_scaling is the head's own
(forward.FinalLogits)."""

from .base import common_args


def model_args(config, body, windows):
    return common_args(
        config,
        body,
        windows,
        embedding_multiplier=float(config.embedding_multiplier),
        residual_multiplier=float(config.residual_multiplier),
    )
