"""The contract between the backend-neutral core and a framework backend.

The decoding loop (mars.core.decoding) drives a backend through `StepBackend`:
`new_cache`, `crop`, `step`. Loading, training and saving are per-backend modules
with the same shape: `load(model, adapter_path=..., dtype=...)` returning a loaded
model with `.tokenizer`, `.mars` (MarsConfig or None) and `.eos_ids`; a
`decoder(loaded)` that implements `StepBackend`; and `finetune(...)`.
"""

from __future__ import annotations

import importlib
import platform

from ..core.decoding import StepBackend  # noqa: F401  (re-exported: the protocol lives with the loop)

BACKENDS = ("torch", "mlx")


class BackendUnavailable(RuntimeError):
    pass


def resolve(name: str = "auto") -> str:
    """`auto` picks MLX on Apple silicon when it is installed, torch elsewhere."""
    if name == "auto":
        if platform.system() == "Darwin" and platform.machine() == "arm64" and importlib.util.find_spec("mlx"):
            name = "mlx"
        else:
            name = "torch"
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    if name == "mlx":
        if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
            raise BackendUnavailable("the mlx backend needs mlx and mlx-lm: pip install 'mars-mtp[mlx]'")
    elif importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        raise BackendUnavailable("the torch backend needs torch and transformers: pip install 'mars-mtp[torch]'")
    return name


def loader(name: str):
    """(load, decoder class) of a resolved backend."""
    if name == "mlx":
        from .mlx.model import MlxDecoder, load

        return load, MlxDecoder
    from .torch.model import TorchDecoder, load

    return load, TorchDecoder


def mask_id_for(loaded) -> int:
    """The mask token a loaded model decodes with: its checkpoint's, or for a plain model
    (decoded below threshold 1 only under --force) the token fine-tuning would pick."""
    from ..core.tokens import choose_mask_token

    if loaded.mars is not None:
        return loaded.mars.mask_token_id
    mask_id = choose_mask_token(loaded.tokenizer, exclude=loaded.eos_ids)[1]
    if mask_id >= loaded.vocab_rows:  # it would have to be added: use a token that exists
        mask_id = loaded.tokenizer.unk_token_id or 0
    return mask_id


def cost_curve(loaded, decoder, *, announce=None):
    """The decoder's per-forward cost curve (mars.core.cost): measured once per model,
    device, dtype, thread count and backend version and kept under the cache directory
    (`MARS_HOME`, default ~/.cache/mars/cost), then loaded. The decoding loop refreshes
    its copy from the forwards it times."""
    import hashlib
    import json

    from ..core.cost import CostCurve, calibrate
    from ..default_model import cache_root

    key = {"model": str(getattr(loaded, "path", "")), **(decoder.cost_key() if hasattr(decoder, "cost_key") else {})}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / "cost" / f"{digest}.json"
    curve = CostCurve.load(path)
    if curve is not None:
        return curve
    if announce:
        announce("measuring what a forward costs on this device (once; kept under the cache directory)")
    mask_id = mask_id_for(loaded)
    curve = calibrate(decoder, [mask_id] * 64, filler=mask_id)
    try:
        curve.save(path, key=key)
    except OSError:
        pass  # a read-only cache: measure again next time
    return curve
