"""mlx-lm models run with explicit positions and masks, in training and in decoding.

mlx-lm's stock forward takes RoPE positions from a scalar cache offset and builds its
own causal mask. MARS needs more: the training sequence repeats positions 0..L-1 for
its two streams under the docs/method.md §3 mask, and batched decoding has holes and per-row
positions. So this module runs mlx-lm's own model (embedding, layers, norms, MLP or experts,
RoPE variant, KV caches) and hands each attention layer, through the cache argument it
already takes, the positions of its tokens and its mask (hidden_states), for the
architectures of mars.checkpoint.architectures' MLX table; `head` applies the model's output head.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...checkpoint.hf_config import position_gaps


def body(model: nn.Module) -> nn.Module:
    return model.model


def embed_tokens(model: nn.Module) -> nn.Module:
    return model.model.embed_tokens


def tied(model: nn.Module) -> bool:
    """Whether the output head is the embedding matrix (mlx-lm builds no `lm_head` then, or
    drops it on loading, as Gemma 3 does)."""
    return "lm_head" not in model


def head(model: nn.Module, hidden: mx.array) -> mx.array:
    """The model's output head on `hidden`, as its mlx-lm `Model.__call__` applies it after the body."""
    out = embed_tokens(model).as_linear(hidden) if tied(model) else model.lm_head(hidden)
    scaling = getattr(model, "logits_scaling", None)  # Granite divides its logits
    return out / scaling if scaling is not None else out


# -- driving mlx-lm's model with explicit positions and masks -------------------------------


class Positions:
    """The logical positions (b, q) of a forward's tokens, handed to every attention layer as
    its cache's `offset`: the layer passes that to its RoPE, which PositionedRope turns into
    one rotation per token (mlx-lm's own offset is one number, or one per row)."""

    def __init__(self, positions: mx.array):
        self.positions = positions


class PositionedRope(nn.Module):
    """An attention layer's RoPE (any variant mlx-lm builds: plain, Llama 3, SuScaled, YaRN,
    Gemma's local and global bases, SmolLM3's NoPE), applied at explicit positions when the
    offset is a Positions, and exactly as before otherwise."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, offset=0):
        if not isinstance(offset, Positions):
            return self.rope(x, offset=offset)
        b, heads, q, d = x.shape
        # One row per token, its position as that row's offset.
        rows = x.transpose(0, 2, 1, 3).reshape(b * q, heads, 1, d)
        out = self.rope(rows, offset=offset.positions.reshape(-1))
        return out.reshape(b, q, heads, d).transpose(0, 2, 1, 3)


def position_ropes(model: nn.Module) -> None:
    """Give every attention layer of an mlx-lm model a PositionedRope (once; no weights change)."""
    for layer in body(model).layers:
        attn = layer.self_attn
        if not isinstance(attn.rope, PositionedRope):
            attn.rope = PositionedRope(attn.rope)


class LayerCache:
    """What one mlx-lm attention layer sees as its cache during a MARS forward: the positions
    as `offset`, the real KV cache behind `update_and_fetch` (none in training: the keys are
    the step's own), and the layer's MARS mask from `make_mask` (mlx-lm's models ask their
    caches for the mask they pass to the layers)."""

    def __init__(self, inner, positions: Positions, mask):
        self.inner = inner
        self.offset = positions
        self.mask = mask

    def update_and_fetch(self, keys, values):
        return (keys, values) if self.inner is None else self.inner.update_and_fetch(keys, values)

    def make_mask(self, *args, **kwargs):
        return self.mask


class Caches(list):
    """The KV caches of a decoder (one per layer) and, for a model with sliding layers, the
    positions of the cached keys (b, kv), kept beside them."""

    key_positions: np.ndarray | None = None


def segment_positions(segments, batch: int) -> np.ndarray:
    """Positions (b, q) of a sequence made of `segments` [(length, offsets (b,) or int)] of
    consecutive positions, e.g. the two MARS streams, each starting at its own offset."""
    parts = []
    for length, offset in segments:
        start = np.broadcast_to(np.asarray(offset, dtype=np.int64).reshape(-1, 1), (batch, 1))
        parts.append(start + np.arange(length, dtype=np.int64)[None])
    return np.concatenate(parts, axis=1)


def layer_windows(model: nn.Module) -> list[int | None]:
    """Per layer, the sliding window of the model's config.json (mars.checkpoint.hf_config), read
    at loading; None everywhere for a model loaded otherwise."""
    return getattr(model, "_mars_windows", None) or [None] * len(body(model).layers)


def layer_masks(model: nn.Module, mask, query_positions: np.ndarray, key_positions: np.ndarray) -> list:
    """Each layer's mask: `mask` (bool (b, 1, q, kv), "causal" or None), cut to the layer's
    sliding window by logical position where some query is that far past a key."""
    windows = layer_windows(model)
    cut = {}
    for window in {w for w in windows if w}:
        gap = position_gaps(query_positions, key_positions)
        if not (gap >= window).any():
            continue
        if isinstance(mask, mx.array):
            allowed = np.array(mask[:, 0])
        else:  # "causal" or None on top of the cache: every key up to the query's own place
            q, kv = gap.shape[1:]
            allowed = np.arange(kv)[None, None] <= (kv - q + np.arange(q))[None, :, None]
        cut[window] = mx.array(allowed & (gap < window))[:, None]
    return [cut.get(w, mask) for w in windows]


def hidden_states(model: nn.Module, inputs: mx.array, positions, mask=None, cache=None, embeddings=None) -> mx.array:
    """The decoder body (mlx-lm's own: embedding scale, layers, norms) at explicit `positions`
    ((b, q) array, or segments [(length, offsets)]) under `mask`: bool (b, 1, q, kv), "causal",
    or None (full attention). `cache`: the decoder's Caches, or None."""
    inner = body(model)
    b, q = inputs.shape
    if isinstance(positions, list):
        positions = segment_positions(positions, b)
    positions = np.asarray(positions, dtype=np.int64)
    keys = positions
    if cache is not None and any(layer_windows(model)):
        cached = cache[0].offset
        before = getattr(cache, "key_positions", None)
        if before is None or before.shape[1] < cached:  # caches kept elsewhere: no holes
            before = np.broadcast_to(np.arange(cached, dtype=np.int64), (b, cached))
        keys = np.concatenate([before[:, :cached], positions], axis=1)
        if isinstance(cache, Caches):
            cache.key_positions = keys
    masks = layer_masks(model, mask, positions, keys) if keys.shape[1] else [mask] * len(inner.layers)
    at = Positions(mx.array(positions.astype(np.int32)))
    caches = [LayerCache(None if cache is None else c, at, m) for c, m in zip(cache or [None] * len(masks), masks)]
    if embeddings is None:
        return inner(inputs, caches)
    # The embeddings are given (a trained mask row): the body embeds through a stand-in that
    # returns them, so every model scales them as it scales its own.
    table = inner.embed_tokens
    inner.embed_tokens = GivenEmbeddings(embeddings)
    try:
        return inner(inputs, caches)
    finally:
        inner.embed_tokens = table


class GivenEmbeddings(nn.Module):
    def __init__(self, embeddings: mx.array):
        super().__init__()
        self._embeddings = embeddings

    def __call__(self, inputs):
        return self._embeddings
