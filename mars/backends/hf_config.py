"""Keys a written Hugging Face config.json needs for every reader (transformers and mlx-lm)."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.files import atomic_write_text


def rope_overrides(config: dict) -> dict:
    """transformers 5 writes RoPE settings as `rope_parameters`; mlx-lm reads `rope_theta` and
    `rope_scaling`, and would otherwise fall back to its own per-architecture defaults."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" in config:
        return {}
    out = {"rope_theta": params["rope_theta"]} if "rope_theta" in params else {}
    if params.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out


def add_rope_keys(directory) -> bool:
    """Give a written Hugging Face directory's config.json the RoPE keys mlx-lm reads
    (`rope_overrides`), atomically; transformers reads the file as before. True if it changed."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    extra = rope_overrides(config)
    if not extra:
        return False
    config.update(extra)
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return True
