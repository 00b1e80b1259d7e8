"""LoRA adapters between PEFT and mlx-lm, exactly.

PEFT: `adapter_model.safetensors` with `base_model.model.<path>.lora_A.weight` (r, in) and
`lora_B.weight` (out, r); y += (lora_alpha / r) * B A x.
mlx-lm: `adapters.safetensors` with `<path>.lora_a` (in, r) and `lora_b` (r, out);
y += scale * (x @ lora_a) @ lora_b, on the last `num_layers` decoder layers.
The trained mask-token row (`mask_embedding.safetensors`) and every other file (mars.json,
tokenizer files) are copied unchanged: both sides use the same names.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..core.files import OutputError, atomic_dir, check_output
from .tensors import ConvertError, Tensor, read_safetensors, write_safetensors

PEFT_WEIGHTS, MLX_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapters.safetensors", "adapter_config.json"
_PEFT_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
_MLX_KEY = re.compile(r"^(.+)\.lora_([ab])$")


def safe_output(output: Path, sources, overwrite: bool) -> None:
    """Refuse an output that would overwrite a source or existing files (core.files.check_output), as a ConvertError."""
    try:
        check_output(
            output, sources=sources, overwrite=overwrite, fix="pass --overwrite to replace it, or choose a new --output"
        )
    except OutputError as e:
        raise ConvertError(str(e)) from None


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass
class Lora:
    """An adapter in one orientation (PEFT's): per module path, A (r, in) and B (out, r)."""

    a: dict[str, Tensor]
    b: dict[str, Tensor]
    rank: int
    scale: float
    dropout: float = 0.0
    base: str = ""
    peft_config: dict | None = None  # the original PEFT config, when known
    mlx_config: dict | None = None  # the original mlx-lm config, when known
    layers: list[int] = field(default_factory=list)

    def delta(self, path: str):
        """scale * B @ A in float32 (out, in)."""
        from .tensors import to_float32

        return self.scale * (to_float32(self.b[path]) @ to_float32(self.a[path]))


def adapter_format(path: Path) -> str | None:
    """'peft', 'mlx' or None (not an adapter directory)."""
    path = Path(path)
    if not path.is_dir() or not (path / ADAPTER_CONFIG).is_file() or (path / "config.json").is_file():
        return None
    if (path / PEFT_WEIGHTS).is_file():
        return "peft"
    if (path / MLX_WEIGHTS).is_file():
        return "mlx"
    raise ConvertError(f"{path}: adapter_config.json without {PEFT_WEIGHTS} (PEFT) or {MLX_WEIGHTS} (mlx-lm)")


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: unreadable JSON ({str(e).splitlines()[0]})") from None


def _check_pairs(path: Path, a: dict, b: dict, rank: int) -> list[int]:
    for name in sorted(set(a) ^ set(b)):
        raise ConvertError(f"{path}: {name} has only one of its two LoRA matrices")
    layers = set()
    for name in a:
        ra, rb = a[name].shape[0], b[name].shape[1]
        if a[name].array.ndim != 2 or b[name].array.ndim != 2 or ra != rank or rb != rank:
            raise ConvertError(
                f"{path}: shape mismatch for {name}: A {list(a[name].shape)}, B {list(b[name].shape)} with rank {rank}"
            )
        m = _LAYER.match(name)
        if not m:
            raise ConvertError(f"{path}: LoRA on {name}, outside the decoder layers, is not supported")
        layers.add(int(m.group(1)))
    if not a:
        raise ConvertError(f"{path}: no LoRA matrices")
    return sorted(layers)


def read_peft(path: Path) -> Lora:
    path = Path(path)
    config = _json(path / ADAPTER_CONFIG)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ConvertError(f"{path}: PEFT type {config.get('peft_type')} is not supported (LoRA only)")
    for key, why in (
        ("use_dora", "DoRA"),
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
        ("modules_to_save", "modules_to_save"),
    ):
        if config.get(key):
            raise ConvertError(f"{path}: {why} ({key}) has no mlx-lm equivalent; convert a plain LoRA adapter")
    if config.get("fan_in_fan_out"):
        raise ConvertError(f"{path}: fan_in_fan_out adapters are not supported")
    rank, alpha = int(config["r"]), config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors, _ = read_safetensors(path / PEFT_WEIGHTS)
    a, b = {}, {}
    for name, t in tensors.items():
        m = _PEFT_KEY.match(name)
        if not m:
            raise ConvertError(
                f"{path / PEFT_WEIGHTS}: tensor {name} is not a LoRA matrix (only LoRA A/B weights convert)"
            )
        (a if m.group(2) == "A" else b)[m.group(1)] = t
    layers = _check_pairs(path / PEFT_WEIGHTS, a, b, rank)
    dropout, base = float(config.get("lora_dropout") or 0.0), config.get("base_model_name_or_path") or ""
    return Lora(a, b, rank, scale, dropout, base, peft_config=config, layers=layers)


def read_mlx(path: Path) -> Lora:
    path = Path(path)
    config = _json(path / ADAPTER_CONFIG)
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ConvertError(f"{path}: mlx-lm fine_tune_type {kind!r} is not supported (lora only)")
    params = config.get("lora_parameters") or {}
    if "rank" not in params or "scale" not in params:
        raise ConvertError(f"{path / ADAPTER_CONFIG}: lora_parameters needs rank and scale")
    rank = int(params["rank"])
    tensors, _ = read_safetensors(path / MLX_WEIGHTS)
    a, b = {}, {}
    for name, t in tensors.items():
        m = _MLX_KEY.match(name)
        if not m:
            raise ConvertError(f"{path / MLX_WEIGHTS}: tensor {name} is not a LoRA matrix (only lora_a/lora_b convert)")
        (a if m.group(2) == "a" else b)[m.group(1)] = t.transpose()
    layers = _check_pairs(path / MLX_WEIGHTS, a, b, rank)
    peft = config.get("peft_config")
    dropout, base = float(params.get("dropout") or 0.0), config.get("model") or ""
    return Lora(a, b, rank, float(params["scale"]), dropout, base, peft_config=peft, mlx_config=config, layers=layers)


def read_adapter(path: Path) -> Lora:
    fmt = adapter_format(path)
    if fmt is None:
        raise ConvertError(f"{path}: not an adapter directory (no adapter_config.json, or it has a config.json)")
    return read_peft(path) if fmt == "peft" else read_mlx(path)


def _keys(lora: Lora, where: Path) -> list[str]:
    """The module paths inside a layer; mlx-lm puts the same ones on every adapted layer."""
    per_layer: dict[int, set] = {}
    for name in lora.a:
        m = _LAYER.match(name)
        per_layer.setdefault(int(m.group(1)), set()).add(m.group(2))
    sets = list(per_layer.values())
    if any(s != sets[0] for s in sets):
        raise ConvertError(
            f"{where}: layers adapt different modules; mlx-lm needs the same modules on every adapted layer"
        )
    return sorted(sets[0])


def _num_layers(lora: Lora, where: Path, total_layers: int | None) -> int:
    layers = lora.layers
    if layers != list(range(layers[0], layers[-1] + 1)):
        raise ConvertError(
            f"{where}: adapted layers {layers} are not consecutive; mlx-lm adapts the last num_layers layers"
        )
    if total_layers is None and lora.peft_config is not None and not lora.peft_config.get("layers_to_transform"):
        total_layers = layers[-1] + 1  # PEFT adapted every matching layer
    if total_layers is None:
        raise ConvertError(
            f"{where}: cannot tell the model's layer count; pass the base model (--model) so the adapter can be placed"
        )
    if layers[-1] != total_layers - 1:
        raise ConvertError(
            f"{where}: adapts layers {layers[0]}..{layers[-1]} of {total_layers}; mlx-lm can only adapt the last layers"
        )
    return total_layers - layers[0]


def _copy_others(src: Path, dst: Path) -> None:
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name not in (PEFT_WEIGHTS, MLX_WEIGHTS, ADAPTER_CONFIG):
            shutil.copy2(p, dst / p.name)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def to_mlx(lora: Lora, src: Path, d: Path, total_layers: int | None) -> None:
    keys = _keys(lora, src)
    num_layers = _num_layers(lora, src, total_layers)
    weights = {}
    for name in lora.a:
        weights[f"{name}.lora_a"] = lora.a[name].transpose()
        weights[f"{name}.lora_b"] = lora.b[name].transpose()
    write_safetensors(d / MLX_WEIGHTS, weights, {"format": "mlx"})
    config = dict(lora.mlx_config or {})
    config.update(
        fine_tune_type="lora",
        num_layers=num_layers,
        lora_parameters={"rank": lora.rank, "scale": lora.scale, "dropout": lora.dropout, "keys": keys},
    )
    if lora.base:
        config["model"] = lora.base
    if lora.peft_config is not None:
        config["peft_config"] = lora.peft_config  # mlx-lm ignores it; the way back restores it exactly
    _write_json(d / ADAPTER_CONFIG, config)


def to_peft(lora: Lora, src: Path, d: Path) -> None:
    weights = {}
    for name in lora.a:
        weights[f"base_model.model.{name}.lora_A.weight"] = lora.a[name]
        weights[f"base_model.model.{name}.lora_B.weight"] = lora.b[name]
    write_safetensors(d / PEFT_WEIGHTS, weights, {"format": "pt"})
    config = lora.peft_config
    if config is None or int(config.get("r", -1)) != lora.rank or not _same_scale(config, lora):
        alpha = lora.scale * lora.rank
        alpha = int(alpha) if float(alpha).is_integer() else alpha
        if lora.layers[0] == 0:  # every layer adapted: the module names suffice
            targets = sorted({n.rsplit(".", 1)[-1] for n in lora.a})
        else:
            targets = sorted(lora.a)  # exact module paths
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": lora.base or None,
            "r": lora.rank,
            "lora_alpha": alpha,
            "lora_dropout": lora.dropout,
            "target_modules": targets,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
        }
    _write_json(d / ADAPTER_CONFIG, config)


def _same_scale(config: dict, lora: Lora) -> bool:
    r, alpha = int(config["r"]), config["lora_alpha"]
    return (alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r) == lora.scale


def _total_layers(base: Path | None) -> int | None:
    if base is None:
        return None
    base = Path(base)
    if base.is_dir() and (base / "config.json").is_file():
        return int(_json(base / "config.json")["num_hidden_layers"])
    return None


def _recorded_base(adapter: Path) -> Path | None:
    """The local base model a MARS adapter's mars.json names, when it is on this machine."""
    config = adapter / "mars.json"
    try:
        recorded = json.loads(config.read_text()).get("base_model") if config.is_file() else None
    except (OSError, ValueError):
        return None
    return Path(recorded) if recorded and Path(recorded).is_dir() else None


def convert_adapter(src, output, to: str, *, base=None, overwrite: bool = False) -> Path:
    """A PEFT adapter directory -> mlx-lm (to='mlx') or mlx-lm -> PEFT (to='hf'), written atomically.
    An existing non-empty `output` is refused unless `overwrite`; the source never is one."""
    src, output = Path(src), Path(output)
    safe_output(output, (src,), overwrite)
    fmt = adapter_format(src)
    if fmt is None:
        raise ConvertError(f"{src}: not an adapter directory (no adapter_config.json, or it has a config.json)")
    if to not in ("hf", "mlx"):
        raise ConvertError(f"--to must be hf or mlx, got {to!r}")
    if (fmt == "peft") == (to == "hf"):
        kind, other = ("PEFT", "mlx") if fmt == "peft" else ("mlx-lm", "hf")
        raise ConvertError(f"{src}: already a {kind} adapter; choose --to {other}")
    lora = read_adapter(src)
    if fmt == "peft":
        guess = base if base is not None else (Path(lora.base) if lora.base else _recorded_base(src))
        total = _total_layers(guess)
        lora_total = total
        _keys(lora, src)
        _num_layers(lora, src, lora_total)  # fail before writing anything

        def write(d: Path):
            to_mlx(lora, src, d, lora_total)
            _copy_others(src, d)
    else:

        def write(d: Path):
            from .card import adapter_card

            to_peft(lora, src, d)
            _copy_others(src, d)
            (d / "README.md").write_text(adapter_card(Path(os.path.abspath(output)), src))

    return atomic_dir(output, write)
