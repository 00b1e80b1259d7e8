"""mlx-lm models run with explicit positions and masks, in training and in decoding.

mlx-lm's stock forward takes RoPE positions from a scalar cache offset and builds its
own causal mask. MARS needs more: the training sequence repeats positions 0..L-1 for
its two streams under the docs/method.md §3 mask, and batched decoding has holes and per-row
positions. So this module runs mlx-lm's own model (embedding, layers, norms, MLP or experts,
RoPE variant, KV caches) and hands each attention layer, through the cache argument it
already takes, the positions of its tokens and its mask (hidden_states), for the
architectures of mars.checkpoint.architectures' MLX table; `head` applies the model's output head.
A decoding step's host inputs reach the device in one copy (`to_device`) and its results come
back in one (`to_host`): each copy waits and costs once, whatever it carries.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def body(model: nn.Module) -> nn.Module:
    return model.model


def embed_tokens(model: nn.Module) -> nn.Module:
    return model.model.embed_tokens


def model_type(model: nn.Module) -> str:
    """The model's `model_type` as mlx-lm keeps it (on the model or its arguments), "?" where neither says."""
    return getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", "?")


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
    """Where a forward's tokens and keys are, on the device: the logical positions (b, q) of its
    tokens, handed to every attention layer as its cache's `offset` (the layer passes that to its
    RoPE, which PositionedRope turns into one rotation per token; mlx-lm's own offset is one
    number, or one per row); and, where a sliding layer's window cuts its mask (`sliding_keys`),
    the positions (b, kv) of the keys attended and the windows that cut (layer_masks)."""

    def __init__(self, positions: mx.array, keys: mx.array | None = None, cuts: tuple[int, ...] = ()):
        self.positions = positions
        self.keys = keys
        self.cuts = cuts


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


def sliding_keys(model: nn.Module, positions: np.ndarray, cache) -> tuple[np.ndarray | None, tuple[int, ...]]:
    """The host's part of the sliding windows, for a forward at `positions` (b, q) on `cache`
    (the decoder's Caches, or None): the positions (b, kv) of the keys it attends, the cached
    keys' (kept on the Caches for the next forward) then its own, and the windows that cut,
    those some query is that far past a key, whose layers' masks layer_masks cuts on the
    device; (None, ()) for a model with no sliding layer. Decided here from positions the host
    has, so that the device is asked for nothing."""
    windows = {w for w in layer_windows(model) if w}
    if not windows:
        return None, ()
    keys = positions
    if cache is not None:
        b, cached = positions.shape[0], cache[0].offset
        before = getattr(cache, "key_positions", None)
        if before is None or before.shape[1] < cached:  # caches kept elsewhere: no holes
            before = np.broadcast_to(np.arange(cached, dtype=np.int64), (b, cached))
        keys = np.concatenate([before[:, :cached], positions], axis=1)
        if isinstance(cache, Caches):
            cache.key_positions = keys
    if not (positions.size and keys.size):
        return keys, ()
    # The largest query-minus-key gap: a row's last query position less its first key position.
    reach = int((positions.max(axis=1) - keys.min(axis=1)).max())
    return keys, tuple(sorted(w for w in windows if reach >= w))


def layer_masks(model: nn.Module, mask, at: Positions) -> list:
    """Each layer's mask: `mask` (bool (b, 1, q, kv), "causal" or None), cut on the device to the
    layer's sliding window by logical position where that window is one of `at.cuts` (a query at
    position p keeps the keys at p - W + 1 .. p that the mask allows)."""
    windows = layer_windows(model)
    if not at.cuts:
        return [mask] * len(windows)
    gap = at.positions[:, None, :, None] - at.keys[:, None, None, :]  # (b, 1, q, kv)
    if isinstance(mask, mx.array):
        allowed = mask
    else:  # "causal" or None on top of the cache: every key up to the query's own place
        q, kv = gap.shape[2:]
        allowed = mx.arange(kv)[None, None, None, :] <= (kv - q + mx.arange(q))[None, None, :, None]
    cut = {w: allowed & (gap < w) for w in at.cuts}
    return [cut.get(w, mask) for w in windows]


def step_mask(cached: int, width: int, batch: int, keys, see, start) -> mx.array:
    """A step's bool attention mask (batch, width, cached + width) built on the device from a
    mars.core.masks.StepMask's arrays there (`keys`, `see`, `start`, each None where the StepMask
    has none), as StepMask.dense builds it on the host."""
    col = mx.arange(-cached, width)  # a key's column among the fed ones (cached: negative)
    return columns_mask(col, width, batch, keys, None if keys is None else keys[:, cached:], see, start)


def columns_mask(col: mx.array, width: int, batch: int, keys, valid, see, start) -> mx.array:
    """StepMask.dense's rule on the device, (batch, width, len(col)): `col` each key's column among
    the fed ones (cached keys negative), `keys` (batch, len(col)) the real keys and `valid` (batch,
    width) the real fed ones (None: every key is), `see` and `start` the StepMask's (None: plain
    causal). A query sees a key at or before its own column in its view, both real; a hole itself."""
    j = mx.arange(width)[:, None]
    allowed = col <= j
    if see is not None:
        allowed = allowed & ((col <= see[:, :, None]) | (col >= start[:, :, None]))
    if keys is not None:
        allowed = (allowed & keys[:, None, :] & valid[:, :, None]) | (col == j)
    return mx.broadcast_to(allowed, (batch, width, col.shape[0]))


def to_device(**arrays) -> dict[str, mx.array]:
    """Host arrays on the device in one copy, by name (None ones left out): integers (that fit
    int32: ids, positions, indices) as int32 and bools as bools. Each copy has a fixed cost and a
    step has many small inputs, so they travel together: packed into one byte buffer, the
    integers first (each then starts 4-byte aligned) and the bools' bytes after, one `mx.array`,
    then cut back out on the device by slices, views and reshapes."""
    parts = {k: np.asarray(v) for k, v in arrays.items() if v is not None}
    ints = {k: np.ascontiguousarray(v, dtype=np.int32) for k, v in parts.items() if v.dtype != np.bool_}
    bools = {k: np.ascontiguousarray(v) for k, v in parts.items() if v.dtype == np.bool_}
    packed = {**ints, **bools}
    buffer = mx.array(np.concatenate([v.reshape(-1).view(np.uint8) for v in packed.values()]))
    out, at = {}, 0
    for name, v in packed.items():
        piece = buffer[at : at + v.nbytes].view(mx.bool_ if v.dtype == np.bool_ else mx.int32)
        out[name], at = piece.reshape(v.shape), at + v.nbytes
    return out


HOST_TYPES = {mx.bool_: np.bool_, mx.int32: np.int32, mx.uint32: np.uint32, mx.int64: np.int64}


def to_host(*arrays: mx.array) -> list[np.ndarray]:
    """Device arrays on the host in one copy, each with its shape and dtype: float32 ones bit for
    bit, integers (that fit int32: ids, counts, indices) and bools by value. One read-back waits
    for the device once and costs once: each array is made int32 on the device (a float32 one by
    a view of its bits), all are flattened into one, read back by one `np.array`, and cut apart
    on the host."""
    flat = []
    for a in arrays:
        if a.dtype != mx.float32 and a.dtype not in HOST_TYPES:
            raise TypeError(f"to_host: {a.dtype} does not travel as int32")
        flat.append((a.view(mx.int32) if a.dtype == mx.float32 else a.astype(mx.int32)).reshape(-1))
    host = np.array(mx.concatenate(flat))
    out, at = [], 0
    for a in arrays:
        piece = host[at : at + a.size]
        piece = piece.view(np.float32) if a.dtype == mx.float32 else piece.astype(HOST_TYPES[a.dtype])
        out.append(piece.reshape(a.shape))
        at += a.size
    return out


def hidden_states(model: nn.Module, inputs: mx.array, positions, mask=None, cache=None, embeddings=None) -> mx.array:
    """The decoder body (mlx-lm's own: embedding scale, layers, norms) at explicit `positions`
    under `mask`: bool (b, 1, q, kv), "causal", or None (full attention). `positions`: a
    Positions on the device (a decoding step's, copied with its other inputs), or host positions,
    (b, q) or segments [(length, offsets)], copied here. `cache`: the decoder's Caches, or None."""
    inner = body(model)
    if not isinstance(positions, Positions):
        b = inputs.shape[0]
        host = segment_positions(positions, b) if isinstance(positions, list) else np.asarray(positions)
        keys, cuts = sliding_keys(model, host, cache)
        sent = to_device(positions=host, keys=keys if cuts else None)
        positions = Positions(sent["positions"], sent.get("keys"), cuts)
    masks = layer_masks(model, mask, positions)
    caches = [LayerCache(c, positions, m) for c, m in zip(cache or [None] * len(masks), masks)]
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
