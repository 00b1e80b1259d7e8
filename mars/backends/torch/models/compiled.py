"""mars's forward (base.Transformer) under `torch.compile`: one graph for every cached length and
width, the per-operation toll of an eager step gone (docs/design.md, "Compiled steps").

What an eager forward does in place, a compiled graph should not: written into a preallocated
cache inside the graph, the keys made inductor copy each layer's cache twice a step (a probe on
the deep, narrow model: 9.3 ms a step against 6.1 eager). So the graph here is pure. It reads the
cached keys and values (exactly the cached length of them, a dynamic dimension: no length buckets,
no recompiles as the cache grows), attends over them and over the step's own keys in one softmax
(two products and their concatenation, not `scaled_dot_product_attention` over a joined copy),
and returns the step's new keys and values beside the logits; two eager copies then write them into
the cache, for every layer at once. The attention mask is built inside the graph from the step's
StepMask tensors, as base.Transformer.attention_masks builds it.

The decoder's weights are the model's own tensors, read by the graph as inputs; dynamo's guards on
them (a shape, stride and dtype check per tensor on every call: about 1 ms a step for 270 tensors)
and on the model's objects and constants (their types, its arguments: another 0.5 ms) are dropped,
and one guard on the model's `signature` (all of that in a string) stands for them.

Arithmetic: the same operations as the eager forward, fused, except attention (a softmax over
the two products, where the eager forward calls the fused kernel) and the gated adapter (its delta
on every row, times the gate's 0/1 column): the logits are not bit for bit the eager forward's,
and the tests compare tokens (tests/test_compiled.py)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ....core.masks import WIDTH_BUCKETS, bucket
from .. import packed
from .base import (
    KVCache,
    Linear,
    StepInputs,
    Transformer,
    additive_masks,
    head_logits,
    rms_norm,
    room_allowed,
    step_allowed,
)

# The inductor cache directory the user set, read before anything of torch's asks for one: inductor
# writes its default (a temporary directory) into the environment the first time it is asked, which
# building a transformers model can do before a compiled step is made.
USER_INDUCTOR_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def inductor_dir(root) -> str:
    """Where inductor keeps what it compiles: the user's TORCHINDUCTOR_CACHE_DIR, else under mars's
    cache directory (`root`)."""
    return USER_INDUCTOR_DIR or str(root / "inductor")


# Dynamo's checks of what the graph reads through `self` that the one check of `self.signature`
# stands for: the model's tensors (shape, stride, dtype), its objects' types and its Python constants
# (arguments, which layers have a bias, an adapter, a pack). About 1,500 of them on a 30-layer model:
# a compiled AR call of the deep, narrow model took 1.5-1.8 ms with them on this CPU, 1.0-1.1 without
# (by hand, the same call 300 times, medians of 7).
DROPPED_GUARDS = ("TENSOR_MATCH", "TYPE_MATCH", "CONSTANT_MATCH")


def _keep_guard(entry) -> bool:
    """Dynamo's guards the compiled step keeps: all but DROPPED_GUARDS on what it reads through
    `self`, save the one on `self.signature` (`signature`), which stands for them."""
    name = entry.name
    return not (
        name.startswith("self.") and entry.guard_type in DROPPED_GUARDS and not name.startswith("self.signature")
    )


def _guards(entries) -> list[bool]:
    return [_keep_guard(e) for e in entries]


# The dimensions of the graph's inputs that vary between steps (its arguments in order: ids, positions,
# reads, keys, values, key positions, allowed, valid, see, start, gate): batch, width, cached length, reads.
DYNAMIC = ((0,), (0, 1), (0,), (1, 3), (1, 3), (0, 1), (0, 1, 2), (0, 1), (0, 1), (0, 1), (0,))
# (keys and values: the cache's whole buffers, (layers, rows allocated, kv heads, room, head dim); key
# positions: (rows allocated, room). The graph reads the cached length off the mask's keys.)


class CompiledStep:
    """`self(cache, inputs)` as base.Transformer's call (the logits of the rows read, the step's keys
    written into `cache`), through one compiled graph for every step with keys cached (a step on an
    empty cache, a prompt's, runs the eager forward). `compiles`: the graphs compiled so far (each
    shape class once: one-token steps, wider steps, a batch's rows; tests count them)."""

    def __init__(self, model: Transformer, mode: str | None = None, fixed: bool | None = None):
        from ....checkpoint.default_model import cache_root

        # inductor keeps what it compiled beside mars's other measurements: a second run starts warm.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir(cache_root())
        self.model = model
        self.compiles = 0
        # Products of 2 rows or more through the CPU decoder's packs (packed.py), where the eager
        # step runs them: on the default model a wide step's products ran 2.5x slower without.
        self.packs = packed.graph_packs([x.base for x in linears(model)])
        # Everything the graph was traced from besides the step's inputs: one guard stands for dynamo's
        # checks of the model's objects (`_guards`).
        self.signature = signature(model, self.packs)
        cuda = model.embed.device.type == "cuda"
        # Fixed shapes (a graph per batch, width bucket and room; the decoder pads to
        # them): what CUDA graphs capture. On a CPU the graph over exactly the cached length was
        # faster (the module's docstring); `fixed` there serves the tests.
        self.fixed = cuda if fixed is None else bool(fixed)
        options = None
        if mode is None:
            options = {"guard_filter_fn": _guards}
            if cuda and self.fixed:
                options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets
            if model.embed.device.type == "cpu" and not self.fixed:
                # The graph's Python wrapper (a view and a size check per weight, every call) in C++:
                # compiled AR 1.18x faster on the deep, narrow model (benchmarks/README.md).
                options["cpp_wrapper"] = True
        if self.fixed:
            # A graph per shape class; dynamo's default of 8 per function would send the rest eager.
            cfg = torch._dynamo.config
            for name, least in (("recompile_limit", FIXED_GRAPHS), ("accumulated_recompile_limit", 4 * FIXED_GRAPHS)):
                if hasattr(cfg, name):
                    setattr(cfg, name, max(getattr(cfg, name), least))
            for t in weight_tensors(model):  # the weights stay where they are: a captured graph reads them there
                torch._dynamo.mark_static_address(t, guard=False)
            self._graph = torch.compile(self._room_forward, dynamic=False, mode=mode, options=options)
        else:
            self._graph = torch.compile(self._forward, dynamic=None, mode=mode, options=options)

    def __call__(self, cache: KVCache, inp: StepInputs) -> torch.Tensor:
        if self.fixed:
            return self._room_step(cache, inp)
        if cache.length == 0 or inp.real is not None or inp.exact is not None:
            return self.model(cache, inp)  # a prompt's step, holes skipped, row-exact attention: eager
        b, w, c = inp.batch, inp.width, cache.length
        dev = inp.positions.device
        cache.reserve(w, b)
        cache.fit_rows()
        # The whole buffers: a slice's strides would tie the graph to the rows and room allocated.
        keys, values, key_positions = cache.keys, cache.values, cache.positions
        allowed, valid, see, start = inp.allowed, inp.keys, inp.see, inp.start
        if allowed is None:  # every part of the StepMask given, each a tensor of its own (its storage
            # offset 0: dynamo specialises offsets 0 and 1), so that steps of one shape meet one graph
            valid = torch.ones((b, c + w), dtype=torch.bool, device=dev) if valid is None else valid.clone()
            see = torch.arange(w, device=dev).repeat(b, 1) if see is None else see.clone()
            start = see.clone() if start is None else start.clone()
        gate = None if inp.gate is None else inp.gate[1]
        args = (inp.ids, inp.positions, inp.reads, keys, values, key_positions, allowed, valid, see, start, gate)
        for t, dims in zip(args, DYNAMIC):
            if t is not None:
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(t, d)
        return self._run(cache, inp, args)

    def _room_step(self, cache: KVCache, inp: StepInputs) -> torch.Tensor:
        """A step through the fixed-shape graph: every step, the prompt's too, at its padded width,
        attending over the cache's whole room (the host gave the mask in that layout and the cached
        length as `inp.length`); the logits of the padded reads."""
        if inp.real is not None or inp.exact is not None or inp.length is None:
            return self.model(cache, inp)  # holes skipped, row-exact attention, no room layout: eager
        cache.reserve(inp.width, inp.batch)
        cache.fit_rows()
        gate = None if inp.gate is None else inp.gate[1]
        args = (inp.ids, inp.positions, inp.reads, cache.keys, cache.values, cache.positions, inp.length)
        args += (inp.allowed, inp.keys, inp.see, inp.start, gate)
        return self._run(cache, inp, args)

    def _run(self, cache: KVCache, inp: StepInputs, args: tuple) -> torch.Tensor:
        """The graph over `args`, its graphs counted; the step's keys and values (and positions) then
        written into the cache at its length, for every layer at once."""
        b, w, c = inp.batch, inp.width, cache.length
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch.inference_mode():
            logits, new_keys, new_values = self._graph(*args)
            self.compiles += torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
            cache.keys[:, :b, :, c : c + w].copy_(new_keys)
            cache.values[:, :b, :, c : c + w].copy_(new_values)
            if cache.positions is not None:
                cache.positions[:b, c : c + w].copy_(inp.positions)
        return logits

    def _forward(self, ids, positions, reads, keys, values, key_positions, allowed, valid, see, start, gate):
        if not self.signature:  # a guard on the model's shapes, for the weights' dropped ones
            raise ValueError("a compiled step without a model")
        m = self.model
        a = m.args
        b, w = positions.shape
        c = (valid.shape[1] if valid is not None else allowed.shape[2]) - w  # the cached length
        keys, values = keys[:, :b, :, :c], values[:, :b, :, :c]
        if key_positions is not None:
            key_positions = key_positions[:b, :c]
        if allowed is None:
            allowed = step_allowed(c, w, b, valid, see, start, positions.device)
        every = torch.cat([key_positions, positions], dim=1) if a.window else None
        masks = additive_masks(allowed, positions, every, a.window, m.dtype)
        return self._body(ids, positions, reads, keys, values, masks, gate)

    def _room_forward(
        self, ids, positions, reads, keys, values, key_positions, length, allowed, valid, see, start, gate
    ):
        """`_forward` at fixed shapes: the cache's whole room (keys (layers, batch, kv heads, room,
        head dim)) under a mask that hides the room past `length`."""
        if not self.signature:
            raise ValueError("a compiled step without a model")
        m = self.model
        a = m.args
        b, w = positions.shape
        room = keys.shape[3]
        if allowed is None:
            allowed = room_allowed(length, room, w, b, valid, see, start)
        every = torch.cat([key_positions, positions], dim=1) if a.window else None
        masks = additive_masks(allowed, positions, every, a.window, m.dtype)
        return self._body(ids, positions, reads, keys, values, masks, gate)

    def _body(self, ids, positions, reads, keys, values, masks, gate):
        """The layers and the head over the cached `keys` and `values` the masks' columns name."""
        m = self.model
        a = m.args
        b, w = positions.shape
        h = F.embedding(ids, m.embed)
        if a.embedding_multiplier != 1.0:
            h = h * a.embedding_multiplier
        rope = m.rope(positions)
        packs = self.packs and b * w >= 2  # (a one-row graph's products run F.linear, as eager AR's do)

        def lin(layer, x, gate):
            return _linear(layer, x, gate, packs)

        new_keys, new_values = [], []
        for i, block in enumerate(m.blocks):
            at = block.attn
            x = rms_norm(h, block.norm1, a.eps)
            q, k, v = at.heads(lin(at.q, x, gate), lin(at.k, x, gate), lin(at.v, x, gate), b, w, rope)
            new_keys.append(k)
            new_values.append(v)
            out = _attend(q, keys[i], values[i], k, v, masks[at.mask_kind], a.scale)
            out = lin(at.o, out.transpose(1, 2).reshape(b * w, a.heads * a.head_dim), gate)
            r = a.residual_multiplier
            h = h + out * r if r != 1.0 else h + out
            mlp = block.mlp
            x = rms_norm(h, block.norm2, a.eps)
            out = lin(mlp.down, mlp.act(lin(mlp.gate, x, gate)) * lin(mlp.up, x, gate), gate)
            h = h + out * r if r != 1.0 else h + out
        h = rms_norm(h.index_select(0, reads), m.norm, a.eps)
        return head_logits(m.head, h, packed.packed_product), torch.stack(new_keys), torch.stack(new_values)


def graph_width(width: int) -> int:
    """The width a fixed-shape step of `width` tokens (or reads) is padded to: the width buckets
    (mars.core.masks.WIDTH_BUCKETS), then powers of two (a prompt's step: a graph per length bucket)."""
    if width <= WIDTH_BUCKETS[-1]:
        return bucket(width)
    return 1 << (width - 1).bit_length()


# Graphs a fixed-shape step may make (batch, width buckets, rooms, prompts' reads): dynamo's limit per function.
FIXED_GRAPHS = 64


def block_linears(block) -> tuple[Linear, ...]:
    """A block's linear layers, in the order the graph's checks list them."""
    at, mlp = block.attn, block.mlp
    return at.q, at.k, at.v, at.o, mlp.gate, mlp.up, mlp.down


def linears(model: Transformer) -> list[Linear]:
    return [x for b in model.blocks for x in block_linears(b)]


def weight_tensors(model: Transformer) -> list[torch.Tensor]:
    """Every tensor of the model the compiled forward reads."""
    out = [model.embed, model.norm, model.inv_freq, *model.head.parameters()]
    for b in model.blocks:
        out += [b.norm1, b.norm2, b.attn.q_norm, b.attn.k_norm]
    for layer in linears(model):
        out += [layer.base.weight, layer.base.bias, *(layer.lora or ())]
    return [t for t in out if t is not None]


def signature(model: Transformer, packs: bool) -> str:
    """What a graph traced over `model` depends on besides the step's inputs: its arguments, dtype and
    device, its rotary scaling, the types of its layers and activations, which layers carry a pack
    and whether the graph uses them, and every weight's shape (which layers have a bias or an
    adapter). Models alike in all of it share graphs, each with its own weights."""
    layers = linears(model)
    kinds = sorted({type(x.base).__qualname__ for x in layers})
    acts = sorted({type(getattr(b.mlp.act, "__self__", b.mlp.act)).__qualname__ for b in model.blocks})
    acts += sorted({getattr(b.mlp.act, "__qualname__", "") for b in model.blocks})
    packed_layers = "".join("1" if "_mars_packed" in x.base.__dict__ else "0" for x in layers)
    packed_layers += f" head {packed.head_packed(model.head)}"
    return (
        f"{model.args}|{model.dtype}|{model.embed.device}|rope {model.rope_scaling}|{kinds}|{acts}|"
        f"packs {bool(packs)} {packed_layers}|{weight_shapes(model)}"
    )


def weight_shapes(model: Transformer) -> str:
    """The shape of every tensor the compiled forward reads (the guard that stands for the weights'
    dropped checks: models whose shapes agree share graphs, each with its own weights)."""

    def shape(t) -> tuple:
        return () if t is None else tuple(t.shape)

    def linear(layer: Linear) -> tuple:
        lora = () if layer.lora is None else tuple(shape(t) for t in layer.lora)
        return shape(layer.base.weight), shape(layer.base.bias), lora

    parts = [shape(model.embed), shape(model.norm), shape(model.inv_freq), type(model.head).__name__]
    parts += [tuple(shape(p) for p in model.head.parameters())]
    for b in model.blocks:
        norms = (b.norm1, b.norm2, b.attn.q_norm, b.attn.k_norm)
        parts.append((*(shape(t) for t in norms), *(linear(x) for x in block_linears(b))))
    return str(parts)


def _linear(layer: Linear, x: torch.Tensor, gate, packs: bool = False) -> torch.Tensor:
    """A checkpoint's linear layer (through its pack where `packs` and it has one), and its gated
    adapter's delta on every row times the gate's column."""
    base = layer.base
    pack = base.__dict__.get("_mars_packed") if packs else None
    if pack is not None:
        y = packed.packed_product(x, pack, base.bias, base.out_features)
    else:
        y = F.linear(x, base.weight, base.bias)
    if layer.lora is None or gate is None:
        return y
    a, b = layer.lora
    return y + torch.mm(torch.mm(x, a) * gate, b)


def _attend(q, cached_keys, cached_values, keys, values, mask, scale: float) -> torch.Tensor:
    """Attention of q (b, heads, w, d) over the cached keys (b, kv heads, c, d) and the step's own
    (b, kv heads, w, d) under the additive `mask` (b, 1, w, c + w): one softmax over both products,
    each key head shared by its query heads."""
    b, heads, w, d = q.shape
    kv = cached_keys.shape[1]
    c = cached_keys.shape[2]
    groups = heads // kv
    qg = q.reshape(b, kv, groups * w, d)
    scores = torch.cat([qg @ cached_keys.transpose(-1, -2), qg @ keys.transpose(-1, -2)], dim=-1) * scale
    scores = scores.view(b, kv, groups, w, c + w) + mask[:, :, None]
    p = torch.softmax(scores, dim=-1).view(b, kv, groups * w, c + w)
    out = p[..., :c] @ cached_values + p[..., c:] @ values
    return out.view(b, heads, w, d)
