"""mars's own decoder forward for the llama family, over a transformers checkpoint's weights.

A transformers model is built to be steered by keyword arguments, masks it builds itself and
caches it owns; the decoder needs none of that. `Transformer` is the forward the decoder runs
instead: small modules holding the checkpoint's own tensors (nothing is copied), an explicit
argument per thing that varies (`StepInputs`: the ids, positions, masks, which positions are
real, which rows to read, the gated adapter's gate, row-exact attention), and a key/value cache
it owns (`KVCache`: preallocated, cropped by setting a length). Nothing inside the forward
branches on the contents of a tensor: what it computes is decided by shapes and by which
arguments are given, on the host, before the call.

The arithmetic is transformers' own, operation for operation (RMSNorm in float32, RoPE from the
model's inverse frequencies, `scaled_dot_product_attention` under an additive mask, SiLU-gated
MLP), so in float32 the forward gives transformers' forward bit for bit under the same mask
(tests/test_lean_forward.py, per architecture). Each family's file (llama.py, qwen2.py, ...) says
what its checkpoints add: a bias, per-head norms, layers without RoPE, multipliers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ....checkpoint.paths import ModelError
from .. import packed


@dataclass(frozen=True)
class ModelArgs:
    """What the forward needs to know about a checkpoint besides its tensors."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float  # the attention's scale (head_dim ** -0.5, or Granite's attention_multiplier)
    rope_layers: tuple[bool, ...]  # per layer: whether it applies RoPE (SmolLM3 leaves some out)
    mask_kinds: tuple[int, ...]  # per layer: which of the step's masks it reads (0 full, 1 sliding)
    window: int | None = None  # the sliding layers' window (keys whose position is less than it behind)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of the queries and keys
    embedding_multiplier: float = 1.0  # Granite
    residual_multiplier: float = 1.0  # Granite


def inference(fn):
    """`@torch.inference_mode()` for a step's functions, at a step's cost: entered through torch's own
    guard where it is off, and not again where it is on (a step's forward and cache calls run inside
    the decoder's step). torch.inference_mode's Python layer (a new context object per call, its
    clone and enter) costs tens of microseconds a call on a cold CPU cache."""
    guard = getattr(torch._C, "_InferenceMode", None)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with guard(True) if guard is not None else torch.inference_mode():
            return fn(*args, **kwargs)

    return run


class KVCache:
    """The keys and values of every layer in preallocated buffers, (layers, batch, kv heads,
    capacity, head dim): a step writes its positions at `length` and attends over the first
    `length + width`; a crop sets `length`; keeping rows or columns gathers them in place. Grows
    (one copy into buffers twice as large) only when a step would pass the capacity. Its buffers
    are inference tensors, written in inference mode only (the decoder's steps run in it)."""

    @inference
    def __init__(self, args: ModelArgs, batch: int, capacity: int, dtype, device):
        self.args = args
        self.batch = batch
        self.length = 0
        shape = (args.layers, batch, args.kv_heads, capacity, args.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # Sliding layers: each cached key's position, (batch, capacity), which the window cuts by.
        self.positions = torch.zeros((batch, capacity), dtype=torch.long, device=device) if args.window else None

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @inference
    def reserve(self, width: int, batch: int) -> None:
        """Room for `width` more positions of `batch` rows."""
        if batch > self.keys.shape[1]:
            self.keep_rows(list(range(self.batch)) + [0] * (batch - self.batch))
        need = self.length + width
        if need <= self.capacity:
            return
        room = max(2 * self.capacity, need + 256)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:3], room, old.shape[4]))
            new[:, :, :, : self.length].copy_(old[:, :, :, : self.length])
            setattr(self, name, new)
        if self.positions is not None:
            new = self.positions.new_zeros((self.positions.shape[0], room))
            new[:, : self.length].copy_(self.positions[:, : self.length])
            self.positions = new

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    @inference
    def keep_rows(self, rows) -> None:
        """Keep these batch rows (indices, in order), gathered in place."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.keys.device)
        n = int(index.numel())
        for name in ("keys", "values"):
            buf = getattr(self, name)
            kept = buf[:, : self.batch, :, : self.length].index_select(1, index)
            if n > buf.shape[1]:  # a served batch gains a row: buffers with room for it
                buf = buf.new_zeros((buf.shape[0], n, *buf.shape[2:]))
                setattr(self, name, buf)
            buf[:, :n, :, : self.length] = kept
        if self.positions is not None:
            kept = self.positions[: self.batch, : self.length].index_select(0, index)
            if n > self.positions.shape[0]:
                self.positions = self.positions.new_zeros((n, self.positions.shape[1]))
            self.positions[:n, : self.length] = kept
        self.batch = n

    @inference
    def fit_rows(self) -> None:
        """Buffers of exactly `batch` rows (a copy, where rows were dropped since they were made): a
        compiled step's graph meets the same layout whatever rows came and went."""
        if self.keys.shape[1] == self.batch:
            return
        self.keys = self.keys[:, : self.batch].clone()
        self.values = self.values[:, : self.batch].clone()
        if self.positions is not None:
            self.positions = self.positions[: self.batch].clone()

    @inference
    def keep_columns(self, columns) -> None:
        """Keep these cached positions (indices, in order), gathered in place."""
        index = torch.as_tensor(columns, dtype=torch.long, device=self.keys.device)
        n = int(index.numel())
        for buf in (self.keys, self.values):
            buf[:, : self.batch, :, :n] = buf[:, : self.batch, :, : self.length].index_select(3, index)
        if self.positions is not None:
            self.positions[: self.batch, :n] = self.positions[: self.batch, : self.length].index_select(1, index)
        self.length = n


@dataclass
class StepInputs:
    """One forward's arguments, on the device.

    `ids` (n,): the real positions' ids, flattened row by row; `real` (n,): where they sit among
    the batch x width positions (None: every position is real, n = batch x width); `positions`
    (batch, width); `reads` (k,): the rows of the n whose logits are wanted; `gate`: a gated
    adapter's gate over the n rows ((rows slice, None) where the masks are one run of rows,
    (None, a 0/1 column (n, 1), integers or the model's dtype: x * 1 and x * 0 are exact either way)
    elsewhere, or None: no mask fed, the base weights alone);
    `exact`: row-exact attention's rows (batch, width) bool and its plans, or None.

    The attention mask (the forward builds it on the device, `attention_masks`): `allowed`, the
    bool mask (batch, width, cached + width) where the caller has one; otherwise the step's
    mars.core.masks.StepMask as tensors: `keys` (batch, cached + width) bool or None (every key
    real), `see` and `start` (batch, width) or None (plain causal).

    A fixed-shape step (compiled.CompiledStep with `fixed`) takes its mask over the cache's whole
    room instead: `length` (1,), the cached length on the device, and `keys` (batch, room + width)
    or `allowed` (batch, width, room + width) with the room's columns past the cached length False
    (the host lays them out so, `room_layout`)."""

    ids: torch.Tensor
    positions: torch.Tensor
    reads: torch.Tensor
    batch: int
    width: int
    real: torch.Tensor | None = None
    gate: tuple | None = None
    exact: tuple | None = None
    allowed: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    see: torch.Tensor | None = None
    start: torch.Tensor | None = None
    length: torch.Tensor | None = None
    plans: dict = field(default_factory=dict)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: in float32, then back to the input's dtype before the weight."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` in three operations: rotate_half(x) is x's
    halves swapped with the first negated, and (-a) * s == a * (-s) exactly, so the sign moves
    into `signed_sin` (sin with its first half negated, made once per forward) and the swap is
    a roll."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class Linear:
    """A checkpoint's linear layer: its weight and bias, the packed copy the CPU decoder made
    (packed.pack_linears), and a gated adapter's low-rank delta (gate.GatedLoRALinear), applied
    where the step's gate says."""

    def __init__(self, layer: torch.nn.Module):
        self.base = getattr(layer, "base", layer)  # the nn.Linear (with its pack, where one was made)
        lora = getattr(layer, "lora_a_t", None)
        self.lora = None if lora is None else (layer.lora_a_t, layer.lora_b_t)

    def __call__(self, x: torch.Tensor, gate) -> torch.Tensor:
        y = packed.linear(self.base, x)
        if self.lora is None or gate is None:
            return y
        a, b = self.lora
        rows, column = gate
        if rows is not None:  # the masks are one run of rows: the delta on them alone
            y[rows].addmm_(torch.mm(x[rows], a), b)
            return y
        return y.addmm_(torch.mm(x, a).mul_(column), b)


class Attention:
    def __init__(self, hf, args: ModelArgs, index: int):
        self.args, self.index = args, index
        self.q, self.k, self.v, self.o = (Linear(getattr(hf, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.q_norm = hf.q_norm.weight if args.qk_norm else None
        self.k_norm = hf.k_norm.weight if args.qk_norm else None
        self.rope = args.rope_layers[index]
        self.mask_kind = args.mask_kinds[index]

    def heads(self, q, k, v, b: int, w: int, rope):
        """The projections (b x w, heads x head dim) as (b, heads, w, head dim), each head's norm and
        RoPE applied where the layer has them."""
        a = self.args
        q = q.view(b, w, a.heads, a.head_dim)
        k = k.view(b, w, a.kv_heads, a.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, a.eps), rms_norm(k, self.k_norm, a.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, w, a.kv_heads, a.head_dim).transpose(1, 2)
        if self.rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def __call__(self, x: torch.Tensor, rope, masks, cache: KVCache, inp: StepInputs) -> torch.Tensor:
        a = self.args
        b, w = inp.batch, inp.width
        q, k, v = self.q(x, inp.gate), self.k(x, inp.gate), self.v(x, inp.gate)
        if inp.real is not None:  # holes: zeros, never attended nor read
            q, k, v = (_scatter(t, inp.real, b * w) for t in (q, k, v))
        q, k, v = self.heads(q, k, v, b, w, rope)
        start, end = cache.length, cache.length + w
        keys, values = cache.keys[self.index, :b], cache.values[self.index, :b]
        keys[:, :, start:end].copy_(k)
        values[:, :, start:end].copy_(v)
        keys, values = keys[:, :, :end], values[:, :, :end]
        mask = masks[self.mask_kind]
        out = None
        if inp.exact is not None:
            from ..attention import row_exact_attention

            out = row_exact_attention(q, keys, values, mask, a.scale, False, exact_rows=inp.exact, plans=inp.plans)
        if out is None:
            out = _sdpa(q, keys, values, mask, a.scale, a.heads // a.kv_heads).transpose(1, 2)
        out = out.reshape(b * w, a.heads * a.head_dim)
        if inp.real is not None:
            out = out.index_select(0, inp.real)
        return self.o(out, inp.gate)


def _sdpa(q, keys, values, mask, scale: float, groups: int) -> torch.Tensor:
    """Attention as transformers' sdpa computes it under a 4D mask: on the CPU each key/value head
    shared by its query heads (`enable_gqa`, the same bits), elsewhere copied per query head."""
    if groups > 1 and q.device.type != "cpu":
        b, h, n, d = keys.shape
        keys = keys[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)
        values = values[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)
        groups = 1
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=groups > 1)


def _scatter(x: torch.Tensor, index: torch.Tensor, total: int) -> torch.Tensor:
    out = x.new_zeros((total, x.shape[-1]))
    return out.index_copy_(0, index, x)


class MLP:
    def __init__(self, hf):
        self.gate, self.up, self.down = Linear(hf.gate_proj), Linear(hf.up_proj), Linear(hf.down_proj)
        self.act = getattr(hf.act_fn, "forward", hf.act_fn)  # the activation's own function: no module call

    def __call__(self, x: torch.Tensor, gate) -> torch.Tensor:
        return self.down(self.act(self.gate(x, gate)) * self.up(x, gate), gate)


class Block:
    def __init__(self, hf, args: ModelArgs, index: int):
        self.args = args
        self.attn = Attention(hf.self_attn, args, index)
        self.mlp = MLP(hf.mlp)
        self.norm1, self.norm2 = hf.input_layernorm.weight, hf.post_attention_layernorm.weight

    def __call__(self, h: torch.Tensor, rope, masks, cache: KVCache, inp: StepInputs) -> torch.Tensor:
        eps, r = self.args.eps, self.args.residual_multiplier
        out = self.attn(rms_norm(h, self.norm1, eps), rope, masks, cache, inp)
        h = h + out * r if r != 1.0 else h + out
        out = self.mlp(rms_norm(h, self.norm2, eps), inp.gate)
        return h + out * r if r != 1.0 else h + out


class Transformer:
    """The decoder's forward (see the module's docstring): `self(cache, inputs)` -> the float32
    logits of the rows read, (k, vocab), with the step's keys and values written into `cache`
    at its length (the caller advances the length). Plain objects, not torch modules: the
    tensors belong to the checkpoint's model, and a module's call costs more than a small op."""

    def __init__(self, hf_body, head, args: ModelArgs):
        self.args = args
        self.embed = hf_body.embed_tokens.weight
        rotary = hf_body.rotary_emb
        self.inv_freq = rotary.inv_freq
        self.rope_scaling = float(rotary.attention_scaling)
        self.blocks = [Block(layer, args, i) for i, layer in enumerate(hf_body.layers)]
        self.norm = hf_body.norm.weight
        self.head = head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def rope(self, positions: torch.Tensor):
        """cos and sin (batch, 1, width, head dim) at `positions`, as transformers' rotary embedding
        computes them (float32, then the model's dtype), the sin with its first half negated
        (apply_rope)."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.to(self.dtype)[:, None], sin.to(self.dtype)[:, None]

    def attention_masks(self, cache: KVCache, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's additive masks (batch, 1, width, cached + width), (full, sliding), built on the
        device from `inp` (StepInputs: the bool mask, or the StepMask's tensors) and, for sliding
        layers, the cached keys' positions (written here, at the cache's length): as
        masks.StepMask.dense and forward.window_cut build them on the host, bit for bit."""
        b, w, c = inp.batch, inp.width, cache.length
        allowed = inp.allowed
        if allowed is None:
            allowed = step_allowed(c, w, b, inp.keys, inp.see, inp.start, inp.positions.device)
        key_positions = None
        if self.args.window:
            cache.positions[:b, c : c + w] = inp.positions
            key_positions = cache.positions[:b, : c + w]
        return additive_masks(allowed, inp.positions, key_positions, self.args.window, self.dtype)

    @inference
    def __call__(self, cache: KVCache, inp: StepInputs) -> torch.Tensor:
        h = F.embedding(inp.ids, self.embed)
        if self.args.embedding_multiplier != 1.0:
            h = h * self.args.embedding_multiplier
        cache.reserve(inp.width, inp.batch)
        rope = self.rope(inp.positions)
        masks = self.attention_masks(cache, inp)
        for block in self.blocks:
            h = block(h, rope, masks, cache, inp)
        h = rms_norm(h.index_select(0, inp.reads), self.norm, self.args.eps)
        return head_logits(self.head, h)


def head_logits(head, h: torch.Tensor, product=None) -> torch.Tensor:
    """The float32 logits of the rows read, `h` (k, hidden): 2 rows or more through the head's pack
    where the decoder made one (packed.pack_head), through `product(x, pack, bias, out_features)` if
    given (a compiled graph's), else `packed.linear`; else the head as the model calls it, on
    (1, k, hidden) as a body's output."""
    inner = packed.head_layer(head)
    pack = inner.__dict__.get("_mars_packed")
    if pack is None or h.shape[0] < packed.MIN_ROWS:
        return head(h[None])[0].float()
    if product is None:
        logits = packed.linear(inner, h)
    else:
        logits = product(h, pack, inner.bias, inner.out_features)
    return (logits if inner is head else head.finish(logits)).float()


def step_allowed(cached, width: int, batch: int, keys, see, start, device) -> torch.Tensor:
    """A StepMask's bool mask (batch, width, cached + width) from its tensors (`keys`, `see`, `start`,
    each None where it has none), as masks.StepMask.dense builds it on the host."""
    col = torch.arange(-cached, width, device=device)  # a key's column among the fed ones (cached: negative)
    return _view_rule(col, width, keys, see, start, cached).expand(batch, width, cached + width)


def room_allowed(length: torch.Tensor, room: int, width: int, batch: int, keys, see, start) -> torch.Tensor:
    """`step_allowed` over a cache's whole room: (batch, width, room + width), the room's columns
    first (those at or past `length`, a (1,) tensor, never seen), then the fed ones; at the live
    columns the same bits as step_allowed's. `keys` (batch, room + width) in that layout (the
    room's part False past the length) or None; `see`, `start` as step_allowed's."""
    index = torch.arange(room + width, device=length.device)
    fed = index >= room
    col = torch.where(fed, index - room, index - length)  # as step_allowed's column: the cached negative
    allowed = _view_rule(col, width, keys, see, start, room, fed) & (fed | (index < length))
    return allowed.expand(batch, width, room + width)


def _view_rule(col, width: int, keys, see, start, first_fed: int, fed=None) -> torch.Tensor:
    """The StepMask's rule over keys at columns `col` (fed ones 0.., cached ones negative; the fed
    keys from index `first_fed` on, `fed` marking them where other columns follow the cached ones):
    causal, narrowed by `see` and `start`, real queries and keys only (`keys`), a query always seeing
    itself."""
    j = torch.arange(width, device=col.device)[:, None]
    allowed = col <= j  # causal
    if see is not None:
        allowed = allowed & ((col <= see[:, :, None]) | (col >= start[:, :, None]))
    if keys is not None:
        itself = col == j if fed is None else fed & (col == j)
        allowed = (allowed & keys[:, None, :] & keys[:, first_fed:, None]) | itself
    return allowed


def room_layout(mask: np.ndarray, cached: int, room: int) -> np.ndarray:
    """A host mask whose last axis is a step's keys (cached + width) laid out over a cache's room as
    a fixed-shape step reads it: the cached columns, False up to the room, then the fed ones."""
    width = mask.shape[-1] - cached
    out = np.zeros(mask.shape[:-1] + (room + width,), dtype=bool)
    out[..., :cached] = mask[..., :cached]
    out[..., room:] = mask[..., cached:]
    return out


def additive_masks(allowed: torch.Tensor, positions, key_positions, window: int | None, dtype):
    """(full, sliding) additive masks (batch, 1, width, keys) from the bool mask: 0 where a query may
    see a key, the dtype's minimum elsewhere; the sliding one also cut where a key's position
    (`key_positions`, (batch, keys)) lies `window` or more behind the query's (None: no window)."""
    kinds = [allowed]
    if window:
        kinds.append(allowed & ((positions[:, :, None] - key_positions[:, None, :]) < window))
    low = torch.finfo(dtype).min
    out = [torch.full(m.shape, low, dtype=dtype, device=m.device).masked_fill_(m, 0.0)[:, None] for m in kinds]
    return out[0], out[-1]


def common_args(config, body, windows, **extra) -> ModelArgs:
    """The arguments every llama-like checkpoint has, read off its config and first attention
    module; `windows` per layer (forward.model_windows); `extra` what a family adds."""
    attn = body.layers[0].self_attn
    layers = len(body.layers)
    sizes = {w for w in windows if w}
    if len(sizes) > 1:
        raise ModelError(f"layers with different sliding windows ({sorted(sizes)}) are not supported")
    fields = dict(
        layers=layers,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim,
        eps=config.rms_norm_eps,
        scale=float(attn.scaling),
        rope_layers=(True,) * layers,
        mask_kinds=tuple(1 if w else 0 for w in windows),
        window=sizes.pop() if sizes else None,
    )
    fields.update(extra)
    return ModelArgs(**fields)
