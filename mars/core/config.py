"""MarsConfig and `mars.json` (docs/method.md §7): what makes a model directory a MARS checkpoint."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .acceptance import METRICS, ThresholdError, check_threshold, threshold_range_text
from .files import atomic_write_text

FILENAME = "mars.json"
FORMAT = 1
# How `mars generate` / `mars chat` decode when given neither --threshold nor --lossless:
# at `default_threshold`, or losslessly (the masks draft, the next forward verifies; output
# exactly the checkpoint's greedy AR). Optional: files without it mean "threshold".
MODES = ("threshold", "lossless")
# Where a LoRA adapter's deltas act: everywhere (the paper's recipe), or at mask positions
# only, so every real token runs the base weights and the model's own output is the base's.
GATES = ("none", "masks")
GATED_FUSE_REFUSED = (
    "a gated adapter (gate: masks) acts only at mask positions; fused into the base weights it would act on "
    "every token and change the model's own output. Use it as an adapter, or train with gate=none to fuse"
)


class ConfigError(ValueError):
    """A mars.json that cannot be used; the message names the file and the field."""


@dataclass
class MarsConfig:
    block_size: int = 4
    mask_token: str = ""
    mask_token_id: int = -1
    ar_weight: float = 1.0
    base_model: str = ""
    metric: str = "probability"
    default_threshold: float = 1.0
    default_mode: str = "threshold"
    gate: str = "none"  # none | masks (GATES): a gated adapter's deltas act at mask positions only
    # True when no unused special token existed and one was added (the embedding grew by a row).
    mask_token_added: bool = False
    format: int = FORMAT

    def validate(self, where: str = FILENAME) -> "MarsConfig":
        def bad(field, why):
            raise ConfigError(f"{where}: field '{field}' {why}")

        if self.format != FORMAT:
            bad("format", f"is {self.format!r}; this version reads format {FORMAT}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            bad("block_size", f"must be an integer >= 1, got {self.block_size!r}")
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            bad("mask_token_id", f"must be a token id >= 0, got {self.mask_token_id!r}")
        if not isinstance(self.mask_token, str) or not self.mask_token:
            bad("mask_token", f"must be the mask token's text, got {self.mask_token!r}")
        if not isinstance(self.ar_weight, (int, float)) or isinstance(self.ar_weight, bool) or self.ar_weight < 0:
            bad("ar_weight", f"must be a number >= 0, got {self.ar_weight!r}")
        if self.metric not in METRICS:
            bad("metric", f"must be one of {', '.join(METRICS)}, got {self.metric!r}")
        try:
            check_threshold(self.metric, self.default_threshold)
        except ThresholdError:
            bad(
                "default_threshold",
                f"must be {threshold_range_text(self.metric)} for metric {self.metric}, got {self.default_threshold!r}",
            )
        if self.default_mode not in MODES:
            bad("default_mode", f"must be one of {', '.join(MODES)}, got {self.default_mode!r}")
        if self.gate not in GATES:
            bad("gate", f"must be one of {', '.join(GATES)}, got {self.gate!r}")
        if not isinstance(self.mask_token_added, bool):
            bad("mask_token_added", f"must be true or false, got {self.mask_token_added!r}")
        return self

    @property
    def lossless_by_default(self) -> bool:
        """Whether a command given no threshold decodes this checkpoint losslessly."""
        return self.default_mode == "lossless"

    def to_dict(self) -> dict:
        return asdict(self)


def read_config(path: str | os.PathLike) -> MarsConfig:
    """Read and validate `mars.json` (a file, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / FILENAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (a MARS checkpoint has a {FILENAME} beside its weights)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    known = {f.name for f in fields(MarsConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown field '{unknown[0]}' (known: {', '.join(sorted(known))})")
    for required in ("block_size", "mask_token", "mask_token_id"):
        if required not in raw:
            raise ConfigError(f"{path}: field '{required}' is missing")
    return MarsConfig(**raw).validate(str(path))


def write_config(cfg: MarsConfig, directory: str | os.PathLike) -> Path:
    """Write `mars.json` into `directory` atomically (temp file, then rename)."""
    cfg.validate()
    return atomic_write_text(Path(directory) / FILENAME, json.dumps(cfg.to_dict(), indent=2) + "\n")


def has_config(directory: str | os.PathLike) -> bool:
    return (Path(directory) / FILENAME).is_file()
