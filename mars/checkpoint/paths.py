"""What both backends need before any framework: checking and resolving model paths, tokenizers."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..core.config import has_config, read_config

# The trained mask-token row beside an adapter: the same name in both backends' adapter directories.
MASK_EMBEDDING_FILE = "mask_embedding.safetensors"
MASK_EMBEDDING_KEY = "mask_embedding"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class ModelError(ValueError):
    """A model path that cannot be loaded; the message names the path and the fix."""


def is_adapter_dir(path: Path) -> bool:
    """A PEFT or mlx-lm adapter directory (both write adapter_config.json; neither a config.json)."""
    return path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def check_model_path(path: Path) -> None:
    if not path.exists():
        raise ModelError(f"{path}: no such file or directory (give a model directory or a .gguf file)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"{path}: a model file must be .gguf (or give a model directory)")
        return
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: no config.json (not a model directory)")
    if not any(p.name.endswith(WEIGHT_SUFFIXES) and p.name != MASK_EMBEDDING_FILE for p in path.iterdir()):
        raise ModelError(f"{path}: no weights (*.safetensors or *.bin) beside config.json")


def mlx_quantization(path: Path) -> dict | None:
    """The `quantization` block of an mlx-lm quantized model directory ({"bits", "group_size", ...}), or None."""
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return None
    q = json.loads(config.read_text()).get("quantization")
    return q if isinstance(q, dict) and "bits" in q else None


def refuse_mlx_quantized(path: Path) -> None:
    """transformers cannot read mlx-lm's packed layers: name the float model that fits instead."""
    q = mlx_quantization(path)
    if q is not None:
        raise ModelError(
            f"{path}: an mlx-lm {q['bits']}-bit model, which the torch backend cannot read; use --backend mlx, or "
            f"dequantize it once (mars convert {path} --to hf --output {path.name}-hf) and pass --model {path.name}-hf "
            "(an adapter trained on it fits the dequantized weights: add --adapter-path ADAPTER)"
        )


def resolve_model_path(
    model: str | os.PathLike | None, adapter: str | os.PathLike | None = None, *, weights: bool = True
):
    """(base path, adapter path or None). `model` may be an adapter directory: its base is then
    read from mars.json or adapter_config.json. None means the embedded default with the
    shipped MARS weights (`weights=False`, or an explicit adapter: without them);
    "default:SmolLM2-135M-Instruct" names the plain default base."""
    from .default_model import DEFAULT_REF, default_model_dir, resolve_named_base, shipped_weights

    if model is None:
        if adapter is None and weights:
            return default_model_dir(), shipped_weights()
        return default_model_dir(), (Path(adapter) if adapter else None)
    if str(model) == DEFAULT_REF:
        return default_model_dir(), (Path(adapter) if adapter else None)
    path = Path(model)
    if adapter is None and is_adapter_dir(path):
        base = read_config(path).base_model if has_config(path) else ""
        if not base:
            config = json.loads((path / "adapter_config.json").read_text())
            base = config.get("base_model_name_or_path") or config.get("model") or ""
        if not base:
            raise ModelError(f"{path}: adapter without a base model; pass --model BASE --adapter-path {path}")
        return resolve_named_base(base), path
    return path, (Path(adapter) if adapter else None)


def portable_ref(base_ref: str) -> str | None:
    """How a model card or adapter config may name a base model: a reference that means the same
    on another machine (a Hub id, the default's name), or None for a local path (mars.json keeps it)."""
    if not base_ref or os.path.isabs(os.path.expanduser(base_ref)) or Path(base_ref).exists():
        return None
    return base_ref


def tokenizer_path(base: Path, adapter: Path | None) -> Path:
    """Where a model's tokenizer lives: the adapter directory's, if it carries one, else the base's."""
    return adapter if adapter is not None and (adapter / "tokenizer_config.json").is_file() else base


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))
