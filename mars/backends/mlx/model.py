"""MLX backend: mlx-lm models run with explicit positions and masks.

mlx-lm's stock forward takes RoPE positions from a scalar cache offset and builds its
own causal mask. MARS needs more: the training sequence repeats positions 0..L-1 for
its two streams under the docs/method.md §3 mask, and batched decoding has holes and per-row
positions. So this module runs mlx-lm's own model (embedding, layers, norms, MLP or experts,
RoPE variant, KV caches) and hands each attention layer, through the cache argument it
already takes, the positions of its tokens and its mask (hidden_states), for the
architectures listed below.
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
from ...checkpoint.architectures import MLX, refusal
from ...checkpoint.hf_config import position_gaps, sliding_windows
from ...checkpoint.hf_config import rope_overrides
from ...checkpoint.paths import MASK_EMBEDDING_FILE, MASK_EMBEDDING_KEY, ModelError, check_model_path, load_tokenizer, resolve_model_path, tokenizer_path

SUPPORTED = MLX  # mars.checkpoint.architectures: the table, as tests/test_architectures.py checks it


class MlxModelError(ModelError):
    """A model the MLX backend cannot use; the message names the path or architecture and the fix."""


@dataclass
class MlxModel:
    model: nn.Module  # an mlx-lm Model of one of the SUPPORTED architectures
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

    @property
    def number_format(self) -> str:
        """"4-bit" (the quantized layers' widths), else the float type most weights have ("float32", "bfloat16")."""
        return number_format(self.model)


def number_format(model: nn.Module) -> str:
    bits = sorted({m.bits for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))})
    if bits:
        return "/".join(map(str, bits)) + "-bit"
    kinds = [str(m.weight.dtype).rsplit(".", 1)[-1] for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    return max(set(kinds), key=kinds.count) if kinds else "float32"


def check_architecture(model: nn.Module, where: str = "model") -> None:
    model_type = getattr(model, "model_type", None) or getattr(model.args, "model_type", "?")
    refused = refusal(model_type, f"{where}/config.json", "mlx")
    if refused:
        raise MlxModelError(refused)


def check_windows(model: nn.Module, windows: list, where: str = "model") -> None:
    """The sliding layers mlx-lm built must be the config's: mlx-lm passes one mask to all the
    layers it treats alike, and mars cuts each mask to the config's window (layer_masks)."""
    layers = body(model).layers
    flags = [bool(getattr(layer, "use_sliding", False) or getattr(layer.self_attn, "is_sliding", False)) for layer in layers]
    alike = flags == [w is not None for w in windows] if any(flags) else len(set(windows)) <= 1
    if len(windows) != len(layers) or not alike:
        raise MlxModelError(
            f"{where}/config.json: the sliding-window layers ({windows}) are not the ones mlx-lm builds for this "
            "architecture; use --backend torch"
        )


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
        if not tied(model) and new_row_init(output_head=True) == "zeros":  # mars.core.tokens
            w = model.lm_head.weight
            model.lm_head.weight = mx.concatenate([w, mx.zeros((grown.shape[0] - w.shape[0], w.shape[1]), dtype=w.dtype)])
    return mars


class MaskRowEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose mask-token row is a float vector of its own, used wherever the
    mask id is fed: a trained row rounded to 4 bits would lose what training put into it, and
    the quantized table (its tied output head too) stays the base's, bit for bit."""

    def __call__(self, x):
        out = super().__call__(x)
        return mx.where((x == self._mars_mask_id)[..., None], self._mars_mask_row.astype(out.dtype), out)


def set_mask_row(model: nn.Module, mask_id: int, row: mx.array) -> None:
    """The trained mask-token row into the model: written into a float embedding, kept beside a
    quantized one (MaskRowEmbedding; not a parameter, so saving the model leaves it out)."""
    emb = embed_tokens(model)
    if isinstance(emb, nn.QuantizedEmbedding):
        emb.__class__ = MaskRowEmbedding
        object.__setattr__(emb, "_mars_mask_id", int(mask_id))
        object.__setattr__(emb, "_mars_mask_row", mx.array(row))
        return
    weight = emb.weight
    emb.weight = mx.concatenate([weight[:mask_id], row.astype(weight.dtype)[None], weight[mask_id + 1 :]])


def quantize_mask_row(model: nn.Module, mask_id: int, row: mx.array) -> None:
    """The trained row quantized into a quantized embedding's own table (a fused model that any
    mlx-lm loader reads with its masks); every other row keeps its bits (groups lie within a row)."""
    emb = embed_tokens(model)
    dtype = emb.scales.dtype
    w, s, *b = mx.quantize(row.astype(dtype)[None], emb.group_size, emb.bits, mode=emb.mode)

    def splice(table, new):
        return mx.concatenate([table[:mask_id], new.astype(table.dtype), table[mask_id + 1 :]])

    emb.weight, emb.scales = splice(emb.weight, w), splice(emb.scales, s)
    if b and emb.get("biases") is not None:
        emb.biases = splice(emb.biases, b[0])


def mlx_adapter(adapter: Path, base: Path, announce=print) -> Path:
    """An mlx-lm adapter directory for `adapter`: itself, or for a PEFT adapter (such as the
    shipped default weights) its conversion, made once and kept in the cache."""
    import hashlib

    from ...checkpoint.adapters import adapter_format, convert_adapter
    from ...checkpoint.default_model import cache_root

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
    config = json.loads((base / "config.json").read_text())
    model_type = config.get("model_type", "?")
    refused = refusal(model_type, f"{base}/config.json", "mlx")
    if refused:
        raise MlxModelError(refused)
    if config.get("final_logit_softcapping") or config.get("attn_logit_softcapping"):
        raise MlxModelError(f"{base}/config.json: soft-capped logits, which mlx-lm's {model_type} does not apply; use --backend torch")
    source = adapter if adapter is not None else base
    try:
        model, wrapper = mlx_load(str(base), model_config=rope_overrides(config))
    except (FileNotFoundError, ValueError) as e:
        raise MlxModelError(f"{base}: could not load ({str(e).splitlines()[0]})") from None
    check_architecture(model, str(base))
    windows = sliding_windows(config)
    check_windows(model, windows, str(base))
    object.__setattr__(model, "_mars_windows", windows)  # a plain attribute, not part of the module tree
    position_ropes(model)
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

        # The number format too: a 4-bit base and the float one read through the same adapter path.
        return {"backend": "mlx", "device": str(mx.default_device()), "mlx": getattr(mx, "__version__", ""),
                "format": self.loaded.number_format}

    def new_cache(self, batch: int):
        from mlx_lm.models.cache import KVCache

        self._drafted = None
        return Caches(KVCache() for _ in body(self.model).layers)

    def crop(self, cache, length: int) -> None:
        for c in cache:
            if c.offset > length:
                c.trim(c.offset - length)

    def keep_rows(self, cache, rows: list[int]) -> None:
        if getattr(cache, "key_positions", None) is not None:
            cache.key_positions = cache.key_positions[rows]
        idx = mx.array(rows, dtype=mx.int32)
        for c in cache if cache is not None else ():
            if c.keys is not None:
                c.keys, c.values = c.keys[idx], c.values[idx]
        if self._drafted is not None:
            self._drafted = self._drafted[idx]

    def keep_keys(self, cache, columns) -> None:
        """Keep only these cache positions of every layer (a served batch drops the keys of rows that left)."""
        if getattr(cache, "key_positions", None) is not None:
            cache.key_positions = cache.key_positions[:, np.asarray(columns, dtype=np.int64)]
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
        h = hidden_states(self.model, ids, positions, attn, cache)
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


def mars_losses(model: nn.Module, batch: dict, mask_row=None, mask_id: int = -1, gate=None, distill=None,
                consistency: float = 0.0):
    """(noisy, clean) losses of a MARS batch (docs/method.md §4), from the arrays of `loss_inputs`;
    `gate`: a gated adapter's MlxMaskGate (the deltas act at mask positions only); the batch's
    "noisy_weights" (slot weights) weigh the noisy stream's targets when present; `consistency`:
    see core.train.loop.TrainSettings (the torch MarsLoss's term, the same numbers)."""
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
    states = h[rows, index]
    logits = head(model, states).astype(mx.float32)
    targets = mx.concatenate([batch["targets"], batch["targets"]])
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    n = batch["targets"].shape[0]
    w = batch["weights"]
    per_token = ce[:n]
    if distill is not None:  # (temperature, mix): the noisy stream learns the clean stream's distribution
        temperature, mix = distill
        kl = distill_kl(logits[:n], logits[n:], temperature)
        per_token = kl if mix >= 1.0 else (1.0 - mix) * per_token + mix * kl
    if consistency:
        student, teacher = states[:n].astype(mx.float32), mx.stop_gradient(states[n:].astype(mx.float32))
        distance = ((student - teacher) ** 2).sum(-1) / mx.maximum((teacher**2).sum(-1), 1e-12)
        per_token = per_token + consistency * distance
    return (per_token * batch.get("noisy_weights", w)).sum(), (ce[n:] * w).sum()


def loss_inputs(ids, labels, lengths, block_size: int, mask_id: int, normalize: str = "row", trim: bool = True,
                slot_weights=()) -> dict:
    """MLX arrays for `mars_losses` from a padded numpy batch; masks and alignment come from the core.
    trim: leave out the noisy blocks no loss reads (masks.noisy_start); the losses are the same.
    slot_weights: the noisy loss's weight per mask slot (core.loss.align)."""
    from ...core.loss import align
    from ...core.masks import noisy_start, training_inputs

    start = noisy_start(labels, block_size) if trim else 0
    input_ids, _, mask = training_inputs(ids, labels, lengths, block_size, mask_id, start=start)
    al = align(labels, normalize, start, block_size, slot_weights)
    return {
        "start": start,  # where the noisy stream begins (a plain int: positions, not data)
        "input_ids": mx.array(input_ids.astype(np.int32)),
        "mask": mx.array(mask)[:, None],
        "rows": mx.array(al.rows.astype(np.int32)),
        "noisy_index": mx.array(al.noisy_index.astype(np.int32)),
        "clean_index": mx.array(al.clean_index.astype(np.int32)),
        "targets": mx.array(al.targets.astype(np.int32)),
        "weights": mx.array(al.weights),
        **({"noisy_weights": mx.array(al.noisy_weights)} if al.noisy_weights is not al.weights else {}),
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
