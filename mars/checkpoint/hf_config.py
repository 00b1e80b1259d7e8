"""Keys a written Hugging Face config.json needs for every reader (transformers and mlx-lm)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..core.files import atomic_write_text


def rope_overrides(config: dict) -> dict:
    """The keys mlx-lm reads that a transformers 5 config.json spells otherwise: RoPE settings
    (transformers writes `rope_parameters`; mlx-lm reads `rope_theta` and `rope_scaling`, and
    would otherwise fall back to its own per-architecture defaults), Gemma 3's
    `sliding_window_pattern` (transformers writes the layers' kinds as `layer_types`; added when
    the kinds follow a pattern), and Qwen3-MoE's `num_experts` (written as `num_local_experts`)."""
    out = {**_rope_keys(config), **_gemma_pattern(config)}
    if config.get("model_type") == "qwen3_moe" and "num_experts" not in config and "num_local_experts" in config:
        out["num_experts"] = config["num_local_experts"]
    return out


def _gemma_pattern(config: dict) -> dict:
    types = config.get("layer_types")
    if config.get("model_type") != "gemma3_text" or "sliding_window_pattern" in config or not isinstance(types, list):
        return {}
    for period in range(1, len(types) + 2):  # every period-th layer attends fully, the others slide
        if all((kind == "full_attention") == ((i + 1) % period == 0) for i, kind in enumerate(types)):
            return {"sliding_window_pattern": period}
    return {}


def _rope_keys(config: dict) -> dict:
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" in config:
        return {}
    out = {}
    if isinstance(params.get("full_attention"), dict):
        # Per layer type (Gemma 3): mlx-lm reads the sliding layers' base as `rope_local_base_freq`.
        local = params.get("sliding_attention")
        if isinstance(local, dict) and "rope_theta" in local and "rope_local_base_freq" not in config:
            out["rope_local_base_freq"] = local["rope_theta"]
        params = params["full_attention"]
    if "rope_theta" in params:
        out["rope_theta"] = params["rope_theta"]
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


def sliding_windows(config: dict) -> list[int | None]:
    """Per layer, the sliding window a transformers model of this config.json applies (a query at
    position p sees keys at positions p - W + 1 .. p), or None for full attention.

    transformers decides it one of two ways: a `layer_types` list ("sliding_attention" layers
    take `sliding_window`; Qwen2/3, Gemma 3, SmolLM3), or, without one, `sliding_window` for
    every layer when it is set (Mistral, Phi-3, Mixtral, Qwen3-MoE)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers = int(text.get("num_hidden_layers") or 0)
    window = text.get("sliding_window")
    window = int(window) if isinstance(window, (int, float)) and window > 0 else None
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window] * layers


def position_gaps(query_positions, key_positions) -> np.ndarray:
    """Query position minus key position, (b, q, kv), or (1, q, kv) when every row has the
    same positions (a training batch): a sliding layer keeps the keys whose gap is below W."""
    q, k = np.asarray(query_positions), np.asarray(key_positions)
    if (q == q[:1]).all() and (k == k[:1]).all():
        q, k = q[:1], k[:1]
    return q[:, :, None] - k[:, None, :]
