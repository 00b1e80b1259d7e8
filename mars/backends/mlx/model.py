"""MLX backend: mlx-lm models run layer by layer with explicit positions and masks.

mlx-lm's stock forward takes RoPE positions from a scalar cache offset and builds its
own causal mask. MARS needs more: the training sequence repeats positions 0..L-1 for
its two streams under the docs/method.md §3 mask, and batched decoding has holes and per-row
positions. So this module reuses mlx-lm's modules and weights (projections, norms,
RoPE, MLP, KV caches) and drives them itself, for the architectures listed below.
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...core.acceptance import speculative_sampling
from ...core.config import MarsConfig, has_config, read_config
from ...core.decode.types import runners_up_of
from ...core.decode.plan import Sampling
from ...core.tokens import eos_ids, mask_config, new_row_init
from ..paths import MASK_EMBEDDING_FILE, MASK_EMBEDDING_KEY, ModelError, check_model_path, load_tokenizer, resolve_model_path, rope_overrides, tokenizer_path

SUPPORTED = ("llama", "qwen2", "qwen3")


class MlxModelError(ModelError):
    """A model the MLX backend cannot use; the message names the path or architecture and the fix."""


@dataclass
class MlxModel:
    model: nn.Module  # an mlx-lm Model (llama, qwen2, qwen3)
    tokenizer: object  # the Hugging Face tokenizer behind mlx-lm's wrapper
    mars: MarsConfig | None
    path: str
    generation_eos: tuple[int, ...] = ()  # config.json's eos_token_id list, as mlx-lm reads it
    gate: object = None  # a gated adapter's MlxMaskGate
    backend = "mlx"  # the mars.backends module that loaded it
    device = "mlx"

    @property
    def vocab_rows(self) -> int:
        return self.model.args.vocab_size

    @property
    def context_length(self) -> int | None:
        """The model's position limit, when its config states one."""
        value = getattr(self.model.args, "max_position_embeddings", None)
        return value if isinstance(value, int) and value > 0 else None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return eos_ids(self.tokenizer, list(self.generation_eos))


def check_architecture(model: nn.Module, where: str = "model") -> None:
    model_type = getattr(model, "model_type", None) or getattr(model.args, "model_type", "?")
    if model_type not in SUPPORTED:
        raise MlxModelError(
            f"{where}: architecture '{model_type}' is not supported by the MLX backend "
            f"(supported: {', '.join(SUPPORTED)}); use --backend torch"
        )


def body(model: nn.Module) -> nn.Module:
    return model.model


def embed_tokens(model: nn.Module) -> nn.Module:
    return model.model.embed_tokens


def head(model: nn.Module, hidden: mx.array) -> mx.array:
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


def _rope(rope, x: mx.array, segments) -> mx.array:
    """RoPE on (b, heads, q, d) where the sequence is `segments` of consecutive positions:
    [(length, offsets (b,) or int)], e.g. the two MARS streams, each starting at 0."""
    if len(segments) == 1:
        return rope(x, offset=segments[0][1])
    parts, start = [], 0
    for length, offset in segments:
        parts.append(rope(x[:, :, start : start + length], offset=offset))
        start += length
    return mx.concatenate(parts, axis=2)


def decode_segments(positions: np.ndarray) -> list:
    """RoPE segments [(length, offsets (b,))] of a decoding step's positions (b, q).

    A step's real slots carry consecutive positions per row (holes, position 0, are masked
    out), so one offset per row usually covers the step. Lossless spare mask groups restart
    their positions: a new segment begins wherever two neighbouring real slots of some row
    are not consecutive."""
    p = np.asarray(positions, dtype=np.int64)
    prev, cur = p[:, :-1], p[:, 1:]
    breaks = ((prev != 0) & (cur != 0) & (cur != prev + 1)).any(axis=0)
    starts = [0] + [int(c) + 1 for c in np.nonzero(breaks)[0]]
    ends = starts[1:] + [p.shape[1]]
    segments = []
    for s, e in zip(starts, ends):
        # Each row's offset comes from its last real slot in the segment (position > 0; a row
        # with none, or only a first token at position 0, gets offset 0). Holes get whatever
        # position follows: they are attended by nobody and never read.
        real = p[:, s:e] != 0
        last = (e - 1 - s) - np.argmax(real[:, ::-1], axis=1)
        offsets = np.where(real.any(axis=1), p[np.arange(len(p)), s + last] - last, 0)
        segments.append((e - s, mx.array(offsets.astype(np.int32))))
    return segments


def _attention(attn, x: mx.array, mask, segments, cache) -> mx.array:
    b, q, _ = x.shape
    queries = attn.q_proj(x).reshape(b, q, attn.n_heads, -1)
    keys = attn.k_proj(x).reshape(b, q, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(b, q, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if hasattr(attn, "q_norm"):  # qwen3 normalises per head before RoPE
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries = _rope(attn.rope, queries.transpose(0, 2, 1, 3), segments)
    keys = _rope(attn.rope, keys.transpose(0, 2, 1, 3), segments)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, q, -1))


def hidden_states(model: nn.Module, inputs: mx.array, segments, mask=None, cache=None, embeddings=None) -> mx.array:
    """The decoder body with explicit positions (`segments`) and a mask: bool (b, 1, q, kv),
    "causal", or None (full attention)."""
    inner = body(model)
    h = inner.embed_tokens(inputs) if embeddings is None else embeddings
    caches = cache if cache is not None else [None] * len(inner.layers)
    for layer, c in zip(inner.layers, caches):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), mask, segments, c)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return inner.norm(h)


# -- loading ---------------------------------------------------------------------------------


def _hf_tokenizer(wrapper):
    return getattr(wrapper, "_tokenizer", wrapper)


def ensure_mask_token(model: nn.Module, tokenizer, mars: MarsConfig | None, *, block_size: int = MarsConfig.block_size, exclude=(),
                      announce=print):
    """The same mask-token choice as the torch backend (mars.core.tokens.mask_config; never an id
    in `exclude`, e.g. the model's EOS ids); grows the embedding when a token is added."""
    mars = mask_config(tokenizer, mars, block_size=block_size, exclude=eos_ids(tokenizer, list(exclude)), announce=announce)
    emb = embed_tokens(model)
    rows = emb.weight.shape[0]
    if mars.mask_token_id >= rows:
        if isinstance(emb, nn.QuantizedEmbedding):
            raise MlxModelError("a quantized model cannot grow its embedding for a new mask token; use a float model")
        grown = mx.concatenate([emb.weight, mx.broadcast_to(emb.weight.mean(0, keepdims=True), (mars.mask_token_id + 1 - rows, emb.weight.shape[1]))])
        emb.weight = grown
        if not model.args.tie_word_embeddings and new_row_init(output_head=True) == "zeros":  # mars.core.tokens
            w = model.lm_head.weight
            model.lm_head.weight = mx.concatenate([w, mx.zeros((grown.shape[0] - w.shape[0], w.shape[1]), dtype=w.dtype)])
    return mars


def set_mask_row(model: nn.Module, mask_id: int, row: mx.array) -> None:
    emb = embed_tokens(model)
    if isinstance(emb, nn.QuantizedEmbedding):
        raise MlxModelError("cannot place a trained mask-token row into a quantized embedding; fuse into a float model")
    weight = emb.weight
    emb.weight = mx.concatenate([weight[:mask_id], row.astype(weight.dtype)[None], weight[mask_id + 1 :]])


def mlx_adapter(adapter: Path, base: Path, announce=print) -> Path:
    """An mlx-lm adapter directory for `adapter`: itself, or for a PEFT adapter (such as the
    shipped default weights) its conversion, made once and kept in the cache."""
    import hashlib

    from ...convert.adapters import adapter_format, convert_adapter
    from ...default_model import cache_root

    if adapter_format(adapter) != "peft":
        return adapter
    digest = hashlib.sha256()
    for f in sorted(p for p in adapter.iterdir() if p.is_file()):
        digest.update(f.name.encode() + f.read_bytes())
    target = cache_root() / "adapters" / f"{adapter.name}-{digest.hexdigest()[:16]}"
    if not (target / "adapters.safetensors").is_file():
        announce(f"converting the PEFT adapter {adapter} for mlx-lm into {target} (once)")
        convert_adapter(adapter, target, "mlx", base=base)
    return target


def load(model_path=None, *, adapter_path=None, announce=print, **_ignored) -> MlxModel:
    """An mlx-lm or Hugging Face directory (through mlx-lm's loader), with an optional mlx-lm adapter."""
    from mlx_lm.utils import load as mlx_load

    base, adapter = resolve_model_path(model_path, adapter_path)
    check_model_path(base)
    if base.is_file():
        raise MlxModelError(f"{base}: the MLX backend loads model directories; import a GGUF with --backend torch")
    model_type = json.loads((base / "config.json").read_text()).get("model_type", "?")
    if model_type not in SUPPORTED:
        raise MlxModelError(f"{base}: architecture '{model_type}' is not supported by the MLX backend (supported: {', '.join(SUPPORTED)}); use --backend torch")
    source = adapter if adapter is not None else base
    try:
        model, wrapper = mlx_load(str(base), model_config=rope_overrides(json.loads((base / "config.json").read_text())))
    except (FileNotFoundError, ValueError) as e:
        raise MlxModelError(f"{base}: could not load ({str(e).splitlines()[0]})") from None
    check_architecture(model, str(base))
    # The base's tokenizer is mlx-lm's; an adapter that carries its own (paths.tokenizer_path) wins.
    where = tokenizer_path(base, adapter)
    tokenizer = _hf_tokenizer(wrapper) if where == base else load_tokenizer(where)
    mars = read_config(source) if has_config(source) else None
    if mars is not None:
        ensure_mask_token(model, tokenizer, mars, announce=announce)
    if adapter is not None:
        from mlx_lm.tuner.utils import load_adapters

        model = load_adapters(model, str(mlx_adapter(adapter, base, announce)))
        row_file = adapter / MASK_EMBEDDING_FILE
        if row_file.is_file() and mars is not None:
            set_mask_row(model, mars.mask_token_id, mx.load(str(row_file))[MASK_EMBEDDING_KEY])
    gate = None
    if adapter is not None and mars is not None and mars.gate == "masks":
        from .gate import MlxMaskGate

        gate = MlxMaskGate(model, mars.mask_token_id)
    model.eval()
    generation_eos = tuple(sorted(int(i) for i in getattr(wrapper, "eos_token_ids", ()) or ()))
    return MlxModel(model=model, tokenizer=tokenizer, mars=mars, path=str(source), generation_eos=generation_eos, gate=gate)


# -- decoding --------------------------------------------------------------------------------


def slot_predictions(logits: mx.array, metric: str, sampling: Sampling, key=None):
    """(ids, confidence) per slot on the device; the same rule as the torch backend."""
    if metric is None and sampling.greedy:
        return mx.argmax(logits, axis=-1), mx.zeros(logits.shape[:-1])
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    probs = mx.exp(logp)
    if sampling.greedy:
        chosen = mx.argmax(logits, axis=-1)
    else:
        chosen = sample(logits, sampling, key)
    if metric == "probability":
        conf = mx.take_along_axis(probs, chosen[..., None], axis=-1)[..., 0]
    elif metric == "margin":
        top2 = mx.topk(probs, 2, axis=-1)
        conf = mx.abs(top2[..., 1] - top2[..., 0])
    else:
        conf = -mx.sum(mx.where(probs > 0, probs * logp, 0.0), axis=-1)
    return chosen, conf


def sample(logits: mx.array, sampling: Sampling, key):
    return mx.random.categorical(sampling_logits(logits, sampling), axis=-1, key=key)


def sampling_logits(logits: mx.array, sampling: Sampling) -> mx.array:
    """Tempered, top-k and top-p filtered logits: the distribution sampling draws from (as
    logits; the torch backend's sampling_probs gives it as probabilities)."""
    z = logits.astype(mx.float32)
    z = (z - mx.max(z, axis=-1, keepdims=True)) / sampling.divisor
    if sampling.top_k and sampling.top_k < z.shape[-1]:
        kth = mx.sort(z, axis=-1)[..., -sampling.top_k][..., None]
        z = mx.where(z < kth, -mx.inf, z)
    if sampling.top_p < 1.0:
        order = mx.argsort(-z, axis=-1)
        sorted_z = mx.take_along_axis(z, order, axis=-1)
        p = mx.softmax(sorted_z, axis=-1)
        drop = (mx.cumsum(p, axis=-1) - p) >= sampling.top_p
        drop[..., 0] = False
        sorted_z = mx.where(drop, -mx.inf, sorted_z)
        z = mx.put_along_axis(mx.full(z.shape, -mx.inf), order, sorted_z, axis=-1)
    return z


class MlxDecoder:
    """The decoding step of docs/method.md §5 for the core loop, on mlx-lm KV caches (trim, never copy)."""

    def __init__(self, loaded: MlxModel):
        self.loaded = loaded
        self.model = loaded.model
        self._key = None
        self._seed = None
        self._drafted = None  # lossless sampling: the last step's mask distributions

    def cost_key(self) -> dict:
        """What a forward's cost depends on besides the model: the cost curve's cache key."""
        import mlx.core as mx

        return {"backend": "mlx", "device": str(mx.default_device()), "mlx": getattr(mx, "__version__", "")}

    def new_cache(self, batch: int):
        from mlx_lm.models.cache import KVCache

        self._drafted = None
        return [KVCache() for _ in body(self.model).layers]

    def crop(self, cache, length: int) -> None:
        for c in cache:
            if c.offset > length:
                c.trim(c.offset - length)

    def keep_rows(self, cache, rows: list[int]) -> None:
        idx = mx.array(rows, dtype=mx.int32)
        for c in cache if cache is not None else ():
            if c.keys is not None:
                c.keys, c.values = c.keys[idx], c.values[idx]
        if self._drafted is not None:
            self._drafted = self._drafted[idx]

    def keep_keys(self, cache, columns) -> None:
        """Keep only these cache positions of every layer (a served batch drops the keys of rows that left)."""
        idx = mx.array(np.asarray(columns, dtype=np.int32))
        for c in cache:
            if c.keys is not None:
                c.keys = mx.take(c.keys[..., : c.offset, :], idx, axis=2)
                c.values = mx.take(c.values[..., : c.offset, :], idx, axis=2)
                c.offset = len(columns)

    def _next_key(self, sampling: Sampling):
        if self._key is None or self._seed != sampling.seed:
            seed = sampling.seed if sampling.seed is not None else int(np.random.SeedSequence().entropy % (2**31))
            self._key, self._seed = mx.random.key(seed), sampling.seed
        self._key, sub = mx.random.split(self._key)
        return sub

    def logits(self, cache, input_ids, positions, mask, read) -> mx.array:
        """One forward of `input_ids` (as `step`): the logits of the `read` columns."""
        ids = mx.array(np.ascontiguousarray(input_ids), dtype=mx.int32)
        attn = "causal" if mask is None else mx.array(mask)[:, None]
        if self.loaded.gate is not None:
            self.loaded.gate.set(ids)
        h = hidden_states(self.model, ids, decode_segments(positions), attn, cache)
        idx = mx.array(np.ascontiguousarray(read), dtype=mx.int32)
        picked = mx.take_along_axis(h, idx[..., None], axis=1)
        return head(self.model, picked)

    def step(self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None, runners_up: int = 0):
        logits = self.logits(cache, input_ids, positions, mask, read)
        key = None if sampling.greedy else self._next_key(sampling)
        chosen, conf = slot_predictions(logits, metric, sampling, key)
        if not (runners_up and sampling.greedy):
            mx.eval(chosen, conf)
            return np.array(chosen), np.array(conf)
        # The n + 1 most likely ids, most likely first: a partition, then a sort of those.
        top = mx.argpartition(-logits, runners_up, axis=-1)[..., : runners_up + 1]
        order = mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1)
        top = mx.take_along_axis(top, order, axis=-1)
        mx.eval(chosen, conf, top)
        ids = np.array(chosen)
        return ids, np.array(conf), runners_up_of(np.array(top), ids, runners_up)

    def speculate(self, cache, input_ids, positions, mask, read, drafts, n_drafts, *, sampling):
        """Lossless sampling (mars.core.decode.loop.StepBackend.speculate), on the device."""
        logits = self.logits(cache, input_ids, positions, mask, read).astype(mx.float32)
        width = drafts.shape[1]
        p = mx.softmax(sampling_logits(logits[:, : width + 1], sampling), axis=-1)
        masks = logits.shape[1] - width - 1  # none when a cost-aware step fed AR's feed alone
        q_next = mx.softmax(sampling_logits(logits[:, width + 1 :], sampling), axis=-1) if masks else logits[:, :0]
        batch = p.shape[0]
        dr = mx.array(np.ascontiguousarray(drafts), dtype=mx.int32)
        n = mx.array(np.ascontiguousarray(n_drafts), dtype=mx.int32)
        u = mx.random.uniform(shape=dr.shape, key=self._next_key(sampling)) if width else None
        q = self._drafted[:, :width] if width else None
        kept, dist = speculative_sampling(MLX_OPS, p, q, dr, n, u)
        token = mx.random.categorical(mx.log(dist), axis=-1, key=self._next_key(sampling))
        if masks:
            proposals = mx.random.categorical(mx.log(q_next), axis=-1, key=self._next_key(sampling))
        else:
            proposals = mx.zeros((batch, 0), dtype=mx.int32)
        self._drafted = q_next
        mx.eval(kept, token, proposals, q_next)
        return np.array(kept), np.array(token), np.array(proposals)


class MlxOps:
    """mars.core.acceptance.DeviceOps on MLX arrays."""

    def arange(self, n):
        return mx.arange(n)

    def zeros_int(self, n):
        return mx.zeros((n,), dtype=mx.int32)

    def zeros_like(self, x):
        return mx.zeros(x.shape)

    def take(self, x, ids):
        return mx.take_along_axis(x, ids[..., None], axis=-1)[..., 0]

    def leading(self, ok):
        return mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)

    def where(self, condition, a, b):
        return mx.where(condition, a, b)

    def minimum(self, x, n):
        return mx.minimum(x, n)

    def at_least(self, x, low):
        return mx.maximum(x, low)

    def row_sum(self, x):
        return x.sum(axis=-1, keepdims=True)


MLX_OPS = MlxOps()


# -- training forward ------------------------------------------------------------------------


def distill_kl(student: mx.array, teacher: mx.array, temperature: float) -> mx.array:
    """Per row: T^2 KL(softmax(teacher / T) || softmax(student / T)), the teacher held fixed."""
    t = temperature
    teacher = mx.stop_gradient(teacher)
    log_p = teacher / t - mx.logsumexp(teacher / t, axis=-1, keepdims=True)
    log_q = student / t - mx.logsumexp(student / t, axis=-1, keepdims=True)
    return (mx.exp(log_p) * (log_p - log_q)).sum(-1) * t * t


def mars_losses(model: nn.Module, batch: dict, mask_row=None, mask_id: int = -1, gate=None, distill=None):
    """(noisy, clean) losses of a MARS batch (docs/method.md §4), from the arrays of `loss_inputs`;
    `gate`: a gated adapter's MlxMaskGate (the deltas act at mask positions only)."""
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
    logits = head(model, h[rows, index]).astype(mx.float32)
    targets = mx.concatenate([batch["targets"], batch["targets"]])
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    n = batch["targets"].shape[0]
    w = batch["weights"]
    per_token = ce[:n]
    if distill is not None:  # (temperature, mix): the noisy stream learns the clean stream's distribution
        temperature, mix = distill
        kl = distill_kl(logits[:n], logits[n:], temperature)
        per_token = kl if mix >= 1.0 else (1.0 - mix) * per_token + mix * kl
    return (per_token * w).sum(), (ce[n:] * w).sum()


def loss_inputs(ids, labels, lengths, block_size: int, mask_id: int, normalize: str = "row", trim: bool = True) -> dict:
    """MLX arrays for `mars_losses` from a padded numpy batch; masks and alignment come from the core.
    trim: leave out the noisy blocks no loss reads (masks.noisy_start); the losses are the same."""
    from ...core.loss import align
    from ...core.masks import noisy_start, training_inputs

    start = noisy_start(labels, block_size) if trim else 0
    input_ids, _, mask = training_inputs(ids, labels, lengths, block_size, mask_id, start=start)
    al = align(labels, normalize, start)
    return {
        "start": start,  # where the noisy stream begins (a plain int: positions, not data)
        "input_ids": mx.array(input_ids.astype(np.int32)),
        "mask": mx.array(mask)[:, None],
        "rows": mx.array(al.rows.astype(np.int32)),
        "noisy_index": mx.array(al.noisy_index.astype(np.int32)),
        "clean_index": mx.array(al.clean_index.astype(np.int32)),
        "targets": mx.array(al.targets.astype(np.int32)),
        "weights": mx.array(al.weights),
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
