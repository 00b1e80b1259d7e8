"""mars's own MLX forward for the llama family (llama, mistral, qwen2, qwen3, smollm3, granite): the
decoding step's body in few operations, for the compiled step (compiled.CompiledMlxStep).

On a device where a step is the toll of its operations, each operation a step leaves out is time
saved. mlx-lm's layers run three projections for the queries, keys and values, two for the MLP's
gate and up, and two rotations. Here each layer runs one projection for q, k and v (their weights
joined), one for gate and up, and one rotation of q and k together: per row where a row's
positions follow one another, else per token.

The joined weights are the model's own memory: each projection's weight (and bias) becomes a
view of the joined one (`_join`), so nothing is held twice and mlx-lm's modules, which the eager
step and training run, read the same values. Only plain float `nn.Linear` projections are joined;
a model with quantized or adapted (LoRA) projections, or any other architecture, runs mlx-lm's
modules in the compiled step (`supports` says why). Arithmetic: the same operations as mlx-lm's
layers, a projection's columns from a wider product (the tests compare tokens)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .forward import PositionedRope, body, model_type
from .static_cache import write

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "granite")


def supports(model: nn.Module) -> str | None:
    """None where the lean forward runs this model, else why not (mlx-lm's modules run it then)."""
    kind = model_type(model)
    if kind not in FAMILIES:
        return f"{kind}: not one of the lean forward's families ({', '.join(FAMILIES)})"
    for i, layer in enumerate(body(model).layers):
        attn, mlp = layer.self_attn, layer.mlp
        parts = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(p) is not nn.Linear for p in parts):
            return f"layer {i}: a quantized or adapted projection"
        for joined in (parts[:3], parts[4:6]):
            if len({"bias" in p for p in joined}) > 1:
                return f"layer {i}: projections to join with a bias and without"
    return None


def _join(modules: list[nn.Linear]) -> tuple[mx.array, mx.array | None]:
    """One weight (and bias) for these projections, their outputs side by side; each module's own
    weight (and bias) becomes a view of it."""
    weight = mx.concatenate([m.weight for m in modules], axis=0)
    bias = mx.concatenate([m.bias for m in modules]) if "bias" in modules[0] else None  # all or none (`supports`)
    at = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = weight[at : at + rows]
        if bias is not None:
            m.bias = bias[at : at + rows]
        at += rows
    return weight, bias


class LeanLayer:
    """One layer's parts: its modules, and in `joined` (a dict, so that a compiled graph's capture of
    it reaches the forward) the joined projections' weights and biases."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads = attn.n_heads, attn.n_kv_heads
        qkv, qkv_bias = _join([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_bias = _join([mlp.gate_proj, mlp.up_proj])
        self.joined = {"qkv": qkv, "gate_up": gate_up}
        if qkv_bias is not None:
            self.joined["qkv_bias"] = qkv_bias
        if gate_up_bias is not None:
            self.joined["gate_up_bias"] = gate_up_bias
        self.o, self.down = attn.o_proj, mlp.down_proj
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = attn.get("q_norm"), attn.get("k_norm")  # qwen3's per-head norms
        rope = attn.rope
        self.rope = rope.rope if isinstance(rope, PositionedRope) else rope
        self.scale = attn.scale
        self.head_dim = qkv.shape[0] // (self.heads + 2 * self.kv_heads)
        # The modules' views too: a graph reads every weight it is given as an evaluated array.
        mx.eval(self.joined, attn.parameters(), mlp.parameters())
        # The views the modules hold: while they do, the joined weights are the model's weights.
        joined = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        self._views = [(m, m.weight, m.get("bias")) for m in joined]

    def fresh(self) -> bool:
        """Whether the modules still hold the views made of the joined weights (training, or a
        loaded adapter fused in, sets new ones)."""
        return all(m.weight is w and m.get("bias") is b for m, w, b in self._views)


class LeanForward:
    """The decoder body of an mlx-lm model of the llama family (`supports`), over a cache of fixed
    room (static_cache.StaticCache's buffers). `of(model)` gives the model's one instance, so that
    the decoders a server makes over one model share its joined weights."""

    @classmethod
    def of(cls, model: nn.Module) -> LeanForward:
        """The model's lean forward: the one made before while its weights are the same, else a new one
        (kept on the model)."""
        kept = getattr(model, "_mars_lean", None)
        if kept is None or not all(layer.fresh() for layer in kept.layers):
            kept = cls(model)
            object.__setattr__(model, "_mars_lean", kept)  # a plain attribute, not a module parameter
        return kept

    def __init__(self, model: nn.Module):
        why = supports(model)
        if why is not None:
            raise ValueError(f"the lean MLX forward does not run this model: {why}")
        inner = body(model)
        self.inner = inner
        self.layers = [LeanLayer(layer) for layer in inner.layers]
        # The arrays the forward reads beside the model's own, where it reads them (a compiled
        # graph's captured inputs: mx.compile swaps these dicts' entries while it traces).
        self.state = [layer.joined for layer in self.layers]
        self.embedding_multiplier = getattr(inner, "embedding_multiplier", None)  # granite
        self.residual_multiplier = getattr(inner.layers[0], "residual_multiplier", None)  # granite

    def __call__(self, ids, positions, allowed, at, keys, values, room: int, consecutive: bool = False):
        """Hidden states (b, w, hidden) of `ids` at `positions` (b, w) under the bool mask `allowed`
        (b, w, room) over the room, the step's keys and values written at `at` into `keys` and
        `values` (per layer (b, kv heads, room, head dim); None on a cache's first step, made here);
        returns them and the two lists. `consecutive`: each row's positions follow one another (one
        rotation per row, from its first position; else one per token)."""
        x = self.inner.embed_tokens(ids)
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        b, w_ = ids.shape
        flat = positions.reshape(-1)
        starts = positions[:, 0]
        mask = allowed[:, None]
        res = self.residual_multiplier
        out_keys, out_values = [], []
        n = len(self.layers)
        for layer, k_cache, v_cache in zip(self.layers, keys or [None] * n, values or [None] * n):
            heads, kv, d = layer.heads, layer.kv_heads, layer.head_dim
            w = layer.joined
            qkv = layer.norm1(x) @ w["qkv"].T
            if "qkv_bias" in w:
                qkv = qkv + w["qkv_bias"]
            qkv = qkv.reshape(b, w_, heads + 2 * kv, d)
            if layer.q_norm is not None:
                qk = mx.concatenate(
                    [layer.q_norm(qkv[:, :, :heads]), layer.k_norm(qkv[:, :, heads : heads + kv])], axis=2
                )
            else:
                qk = qkv[:, :, : heads + kv]
            if consecutive:  # each row's tokens at consecutive positions: one rotation per row
                qk = layer.rope(qk.transpose(0, 2, 1, 3), offset=starts)
            else:  # every token at its own position: one row per token, its position as its offset
                qk = layer.rope(qk.reshape(b * w_, heads + kv, 1, d), offset=flat)
                qk = qk.reshape(b, w_, heads + kv, d).transpose(0, 2, 1, 3)
            k_cache = write(k_cache, qk[:, heads:], at, room)
            v_cache = write(v_cache, qkv[:, :, heads + kv :].transpose(0, 2, 1, 3), at, room)
            o = mx.fast.scaled_dot_product_attention(qk[:, :heads], k_cache, v_cache, scale=layer.scale, mask=mask)
            o = layer.o(o.transpose(0, 2, 1, 3).reshape(b, w_, heads * d))
            x = x + (o * res if res is not None else o)
            gu = layer.norm2(x) @ w["gate_up"].T
            if "gate_up_bias" in w:
                gu = gu + w["gate_up_bias"]
            g, u = mx.split(gu, 2, axis=-1)
            m = layer.down(nn.silu(g) * u)
            x = x + (m * res if res is not None else m)
            out_keys.append(k_cache)
            out_values.append(v_cache)
        return self.inner.norm(x), out_keys, out_values
