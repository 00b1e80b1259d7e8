"""Loading a model for the MLX backend: an mlx-lm or Hugging Face directory through mlx-lm's
loader, checked against the architectures MLX runs, with its tokenizer, MARS config and mask
token, an adapter (a PEFT one converted once) with its mask-token row and gate (MlxModel)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ...checkpoint.architectures import MLX, refusal
from ...checkpoint.hf_config import rope_overrides, sliding_windows
from ...checkpoint.paths import (
    MASK_EMBEDDING_FILE,
    MASK_EMBEDDING_KEY,
    ModelError,
    check_model_path,
    load_tokenizer,
    resolve_model_path,
    tokenizer_path,
)
from ...core.config import MarsConfig, has_config, read_config
from ...core.tokens import eos_ids, mask_config, new_row_init
from .forward import body, embed_tokens, model_type, position_ropes, tied

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
        """ "4-bit" (the quantized layers' widths), else the float type most weights have ("float32", "bfloat16")."""
        return number_format(self.model)


def number_format(model: nn.Module) -> str:
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    bits = sorted({m.bits for _, m in model.named_modules() if isinstance(m, quantized)})
    if bits:
        return "/".join(map(str, bits)) + "-bit"
    kinds = [
        str(m.weight.dtype).rsplit(".", 1)[-1]
        for _, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding))
    ]
    return max(set(kinds), key=kinds.count) if kinds else "float32"


def check_architecture(model: nn.Module, where: str = "model") -> None:
    refused = refusal(model_type(model), f"{where}/config.json", "mlx")
    if refused:
        raise MlxModelError(refused)


def check_windows(model: nn.Module, windows: list, where: str = "model") -> None:
    """The sliding layers mlx-lm built must be the config's: mlx-lm passes one mask to all the
    layers it treats alike, and mars cuts each mask to the config's window (layer_masks)."""
    layers = body(model).layers
    flags = [
        bool(getattr(layer, "use_sliding", False) or getattr(layer.self_attn, "is_sliding", False)) for layer in layers
    ]
    alike = flags == [w is not None for w in windows] if any(flags) else len(set(windows)) <= 1
    if len(windows) != len(layers) or not alike:
        raise MlxModelError(
            f"{where}/config.json: the sliding-window layers ({windows}) are not the ones mlx-lm builds for this "
            "architecture; use the torch backend"
        )


def _hf_tokenizer(wrapper):
    return getattr(wrapper, "_tokenizer", wrapper)


def ensure_mask_token(
    model: nn.Module,
    tokenizer,
    mars: MarsConfig | None,
    *,
    block_size: int = MarsConfig.block_size,
    exclude=(),
    announce=print,
):
    """The same mask-token choice as the torch backend (mars.core.tokens.mask_config; never an id
    in `exclude`, e.g. the model's EOS ids); grows the embedding when a token is added."""
    mars = mask_config(
        tokenizer, mars, block_size=block_size, exclude=eos_ids(tokenizer, list(exclude)), announce=announce
    )
    emb = embed_tokens(model)
    rows = emb.weight.shape[0]
    if mars.mask_token_id >= rows:
        if isinstance(emb, nn.QuantizedEmbedding):
            raise MlxModelError("a quantized model cannot grow its embedding for a new mask token; use a float model")
        shape = (mars.mask_token_id + 1 - rows, emb.weight.shape[1])
        new_rows = mx.broadcast_to(emb.weight.mean(0, keepdims=True), shape)
        grown = mx.concatenate([emb.weight, new_rows])
        emb.weight = grown
        if not tied(model) and new_row_init(output_head=True) == "zeros":  # mars.core.tokens
            w = model.lm_head.weight
            zeros = mx.zeros((grown.shape[0] - w.shape[0], w.shape[1]), dtype=w.dtype)
            model.lm_head.weight = mx.concatenate([w, zeros])
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
        raise MlxModelError(f"{base}: the MLX backend loads model directories; import a GGUF with the torch backend")
    config = json.loads((base / "config.json").read_text())
    model_type = config.get("model_type", "?")
    refused = refusal(model_type, f"{base}/config.json", "mlx")
    if refused:
        raise MlxModelError(refused)
    if config.get("final_logit_softcapping") or config.get("attn_logit_softcapping"):
        raise MlxModelError(
            f"{base}/config.json: soft-capped logits, which mlx-lm's {model_type} does not apply; use the torch backend"
        )
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
    return MlxModel(
        model=model, tokenizer=tokenizer, mars=mars, path=str(source), generation_eos=generation_eos, gate=gate
    )
