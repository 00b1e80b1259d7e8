"""A key/value cache that grows in place, for the torch decoder.

transformers' `DynamicLayer` appends a step's keys and values with `torch.cat`: every
forward copies the whole cache of every layer, so a step's copying grows with the
sequence. On the default model (one CPU core) that is lost in the noise of 128-token
replies, but with 1,500 positions cached a one-token forward cost 73.8 ms with `torch.cat`
and 65.6 ms with this cache (3 tokens: 83.3 and 74.4 ms). `GrowingLayer` keeps each layer's keys and values in a
buffer with room to spare and writes a step's new positions into it; what attention reads
is a view of the buffer's first positions, the same numbers `torch.cat` would give.
Cropping (the decoder's `crop`: rejected drafts leave the cache) only shortens the view,
so the next step writes over the dead positions. When the buffer is full, it is copied
once into one twice as large.

The decoder may also replace a layer's `keys` and `values` with tensors of its own
(`keep_rows`, `keep_keys`: a batch's rows or positions selected); the next `update` sees
they are not views of the buffer and starts a new buffer from them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

# Positions of spare room a new buffer gets beyond what it must hold at once.
SPARE = 256


class GrowingLayer(DynamicLayer):
    """`DynamicLayer` with in-place appends (see the module's docstring)."""

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None

    def _in_buffer(self) -> bool:
        """Whether `keys`/`values` are still the buffer's first positions (not replaced)."""
        k, buf = self.keys, self._kbuf
        return (
            buf is not None
            and k.dim() == 4
            and k.data_ptr() == buf.data_ptr()
            and k.shape[:2] == buf.shape[:2]
            and k.stride() == buf.stride()
            and self.values.data_ptr() == self._vbuf.data_ptr()
            and self.values.shape[:3] == k.shape[:3]
        )

    def _regrow(self, length: int, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """A new buffer with room for `need` positions and more, holding the first `length` positions of today's."""
        b, h = like_k.shape[:2]
        room = max(2 * need, need + SPARE)
        kbuf = like_k.new_empty((b, h, room, like_k.shape[-1]))
        vbuf = like_v.new_empty((b, h, room, like_v.shape[-1]))
        if length:
            kbuf[:, :, :length].copy_(self.keys)
            vbuf[:, :, :length].copy_(self.values)
        self._kbuf, self._vbuf = kbuf, vbuf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        if length and not self._in_buffer():  # keys/values were replaced (rows or positions selected)
            self._kbuf = self._vbuf = None
        buf = self._kbuf
        if (
            buf is None
            or buf.shape[:2] != key_states.shape[:2]
            or end > buf.shape[-2]
            or buf.dtype != key_states.dtype
            or buf.device != key_states.device
        ):
            self._regrow(length, end, key_states, value_states)
        self._kbuf[:, :, length:end].copy_(key_states)
        self._vbuf[:, :, length:end].copy_(value_states)
        self.keys = self._kbuf[:, :, :end]
        self.values = self._vbuf[:, :, :end]
        return self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


def growing_cache(config):
    """A transformers `DynamicCache` for `config` whose attention layers all keep every
    position and grow in place. A sliding-window layer of transformers keeps only the last
    `sliding_window` positions, which the decoder's crops (counted from the start) and masks
    (one column per cached position) cannot follow; here the window is applied by the masks
    instead (mars.backends.torch.forward.attention_masks), by position."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if _attention_layer(layer) else layer for layer in cache.layers]
    return cache


def full_cache(config):
    """A transformers `DynamicCache` whose attention layers keep every position (plain appends,
    so gradients flow through the keys): the training forward's cache, masked by position."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if _attention_layer(layer) else layer for layer in cache.layers]
    return cache


def _attention_layer(layer) -> bool:
    """A plain or sliding-window key/value layer (not a linear-attention or quantized one)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)


def cache_argument(body, cache) -> dict:
    """The keyword a transformers model's forward takes its cache by: `cache` from transformers
    5.24, `past_key_values` before (mars supports 5.17 and later). Read off the forward's own
    signature, once per model class: an unknown keyword would be swallowed by `**kwargs` and
    the model would run with no cache at all."""
    kind = type(body)
    name = _CACHE_KEYWORD.get(kind)
    if name is None:
        import inspect

        params = inspect.signature(kind.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        if name not in params:
            raise TypeError(
                f"{kind.__name__}.forward takes neither `cache` nor `past_key_values`: this transformers is not "
                f"supported"
            )
        _CACHE_KEYWORD[kind] = name
    return {name: cache}


_CACHE_KEYWORD: dict[type, str] = {}
