"""The contract between the backend-neutral code and a framework backend (torch, MLX).

Everything outside `mars/backends` reaches a backend through the functions here, never by
importing `mars.backends.torch` or `mars.backends.mlx` itself:

- `resolve(name)`: "auto", "torch" or "mlx" -> an installed backend's name;
- `load(name, model, adapter_path=..., dtype=..., device=..., announce=...)`: the loaded
  model, with `.model`, `.tokenizer`, `.mars` (MarsConfig or None), `.eos_ids`, `.path`,
  `.vocab_rows`, `.context_length` (the position limit, or None), `.device` and `.backend`
  (its backend's name);
- `decoder(loaded)` / `decoder_class(name)`: the decoding step, a StepBackend (defined with
  the loop in mars.core.decode.loop: `new_cache`, `crop`, `keep_rows`, `step`, `speculate`,
  `cost_key`, and `keep_keys(cache, columns)` for the server's batch); `loader(name)` gives
  `(load, decoder class)` together;
- `trainer(name)`: the trainer class, `Trainer(loaded, mars, TrainSettings, output)` with
  `.trainable`, `.train(train, valid, resume=..., log=...)` and `.save(tokenizer, base_ref,
  fuse=...)`; `ensure_mask_token(loaded, mars, ...)` readies the mask token before training;
- `losses(loaded)`: the training forward and loss without gradients, per batch (eval's NLL);
- `context_length(loaded)`, `mask_id_for(loaded)`, `plan_for_model(loaded, ...)` (the
  plan of mars.core.decode.plan for a loaded model) and `cost_curve(loaded, decoder)` / `costs(loaded, decoder)`;
"""

from __future__ import annotations

import importlib
import platform

from ..core.decode import rules

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


def _model_module(name: str):
    if name == "mlx":
        from . import mlx as model
    else:
        from . import torch as model
    return model


def load(name: str, model=None, *, adapter_path=None, dtype=None, device=None, announce=print):
    """Load `model` (HF or mlx-lm directory, .gguf file, MARS adapter directory, None: the
    embedded default) with the resolved backend `name`. MLX ignores dtype and device."""
    return _model_module(name).load(model, adapter_path=adapter_path, dtype=dtype, device=device, announce=announce)


def decoder_class(name: str):
    """The backend's StepBackend class: `cls(loaded)` decodes with a loaded model."""
    module = _model_module(name)
    return module.MlxDecoder if name == "mlx" else module.TorchDecoder


def decoder(loaded, *, compile: bool = False, on_compile_error=None):
    """A decoding step (StepBackend) over a loaded model's weights; `compile`: its steps under
    `torch.compile` (torch) or `mx.compile` (MLX); `on_compile_error`: a compiled step that fails
    is dropped for eager ones, and this is called with a message saying why."""
    cls = decoder_class(loaded.backend)
    if not compile:
        return cls(loaded)
    return cls(loaded, compile=True, on_compile_error=on_compile_error)


def loader(name: str):
    """(load, decoder class) of a resolved backend."""
    return _model_module(name).load, decoder_class(name)


def trainer(name: str):
    """The backend's trainer class."""
    if name == "mlx":
        from .mlx.train import MlxTrainer

        return MlxTrainer
    from .torch.train import TorchTrainer

    return TorchTrainer


def ensure_mask_token(loaded, mars, *, block_size: int = rules.DEFAULT_BLOCK_SIZE, announce=print):
    """The MarsConfig to train with: `mars`, or for None the mask token chosen for the model
    (mars.core.tokens.mask_config); the token and the embedding row it needs are made to exist."""
    return _model_module(loaded.backend).ensure_mask_token(
        loaded.model, loaded.tokenizer, mars, block_size=block_size, exclude=loaded.eos_ids, announce=announce
    )


def losses(loaded):
    """`step(ids, labels, lengths, block_size, mask_id) -> (noisy, clean)`: mean losses per
    labelled token of a padded batch, from the training forward and loss, without gradients."""
    return _model_module(loaded.backend).losses(loaded)


def context_length(loaded) -> int | None:
    """The model's position limit, when its config states one."""
    return loaded.context_length


def mask_id_for(loaded) -> int:
    """The mask token a loaded model decodes with: its checkpoint's, or for a plain model
    (decoded below AR mode only when forced) the token fine-tuning would pick."""
    from ..core.tokens import choose_mask_token

    if loaded.mars is not None:
        return loaded.mars.mask_token_id
    mask_id = choose_mask_token(loaded.tokenizer, exclude=loaded.eos_ids)[1]
    if mask_id >= loaded.vocab_rows:  # it would have to be added: use a token that exists
        mask_id = loaded.tokenizer.unk_token_id or 0
    return mask_id


def plan_for_model(loaded, **asked):
    """mars.core.decode.plan.make_plan for a loaded model: its checkpoint, mask token, EOS ids and
    draft corpus, plus what was asked (threshold, lossless, verify, metric, block size, force,
    other fields)."""
    from ..core.decode.plan import make_plan

    if "corpus" not in asked and "drafts" not in asked:
        asked["corpus"] = draft_corpus(loaded)
    asked.setdefault("numerics", getattr(loaded, "number_format", "float32"))
    return make_plan(loaded.mars, mask_id=mask_id_for(loaded), eos_ids=loaded.eos_ids, **asked)


def draft_corpus(loaded):
    """The draft corpus kept beside the loaded checkpoint (mars.core.decode.drafts.corpus.FILE), or None;
    read once per loaded model."""
    from ..core.decode.drafts.corpus import beside

    if not hasattr(loaded, "_draft_corpus"):
        object.__setattr__(loaded, "_draft_corpus", beside(getattr(loaded, "path", None) or None))
    return loaded._draft_corpus


def costs(loaded, decoder, *, announce=None, remeasure: bool = False):
    """The decoder's per-forward costs for the cost-aware policy (mars.core.decode.cost.BatchCosts):
    the one-row curve now, a batch's curve when a batch of that size first decodes.
    `remeasure`: measure them again rather than read the kept ones."""
    from ..core.decode.cost import BatchCosts

    return BatchCosts(
        cost_curve(loaded, decoder, announce=announce, remeasure=remeasure),
        measure=lambda batch: cost_curve(loaded, decoder, announce=announce, batch=batch, remeasure=remeasure),
    )


REMEASURE_HINT = "--remeasure-cost measures it again, thoroughly"

# "auto" compiles a CPU's steps where the kept curves say a compiled forward costs at most this
# share of an eager one at one token (every mode's step) and no more at the widest both measured.
COMPILED_PAYS = 0.9


def curve_key(loaded, decoder_key: dict, batch: int = 1) -> dict:
    """What a kept cost curve of this model under a decoder of `decoder_key` (its cost_key) is kept by."""
    gate = loaded.mars.gate if loaded.mars is not None else "none"
    # "calibration" versions the measurement method, so stored curves measured another way are not reused.
    key = {"model": str(getattr(loaded, "path", "")), "gate": gate, "calibration": 4, **decoder_key}
    if batch > 1:
        key["batch"] = batch
    return key


def compiled_pays(loaded, decoder) -> tuple[bool, str] | None:
    """Whether the kept one-row cost curves of this model, eager (`decoder`, an eager torch
    decoder) and compiled (measured by a run with --compile on), say compiled steps pay here:
    (verdict, the figures), or None where either was never measured or the model has no
    compiled step."""
    from ..checkpoint.default_model import keyed_cache_file
    from ..core.decode import cost

    if getattr(decoder, "lean", None) is None or getattr(decoder, "compiled", None) is not None:
        return None
    eager_key = decoder.cost_key()
    curves = [
        cost.CostCurve.load(keyed_cache_file("cost", curve_key(loaded, k)))
        for k in (eager_key, {**eager_key, "compiled": 1})
    ]
    if None in curves:
        return None
    eager, compiled = curves
    widest = min(max(eager.points), max(compiled.points))
    one, wide = compiled.seconds(1) / eager.seconds(1), compiled.seconds(widest) / eager.seconds(widest)
    pays = one <= COMPILED_PAYS and wide <= 1.0
    return pays, f"a compiled step costs {one:.2f}x an eager one at 1 token and {wide:.2f}x at {widest}"


def cost_curve(loaded, decoder, *, announce=None, batch: int = 1, remeasure: bool = False):
    """The decoder's per-forward cost curve (mars.core.decode.cost) for forwards of `batch` rows:
    measured once per model, device, dtype, thread count, backend version and batch size
    and kept under the cache directory (`MARS_HOME`, default ~/.cache/mars/cost), then
    loaded; measured again where the kept one is not non-decreasing, or with `remeasure`.
    The first measurement is a short probe (cost.PROBE_WIDTHS, a few seconds on the default
    model); `remeasure` times the thorough one (cost.CALIBRATION_WIDTHS, more rounds).
    `announce` hears, before a measurement, what it is, about how long it takes and where
    its result is kept. The decoding loop refreshes its copy from the forwards it times."""
    from ..checkpoint.default_model import keyed_cache_file
    from ..core.decode import cost

    key = curve_key(loaded, decoder.cost_key() if hasattr(decoder, "cost_key") else {}, batch)
    path = keyed_cache_file("cost", key)
    curve = None if remeasure else cost.CostCurve.load(path)
    if curve is not None:
        return curve
    rows = f" of {batch} rows" if batch > 1 else ""
    why = " again (the kept curve was not non-decreasing)" if path.exists() and not remeasure else ""

    how = "thoroughly, " if remeasure else "a short probe, "

    def before(seconds: float) -> None:
        if announce:
            announce(
                f"measuring what a forward{rows} costs on this device{why} ({how}once, about "
                f"{max(1, round(seconds))} s, more on a busy machine; refined as it decodes; "
                f"kept in {path}; {REMEASURE_HINT})"
            )

    mask_id = mask_id_for(loaded)
    # Wide forwards feed masks (a gated adapter works there), a one-token forward is AR.
    # A batch's widths are per row; its curve is in total fed tokens.
    if remeasure:
        widths, rounds = (
            (cost.CALIBRATION_WIDTHS if batch == 1 else cost.BATCH_CALIBRATION_WIDTHS),
            cost.CALIBRATION_ROUNDS,
        )
    else:
        widths, rounds = (cost.PROBE_WIDTHS if batch == 1 else cost.BATCH_PROBE_WIDTHS), cost.PROBE_ROUNDS
    curve = cost.calibrate(
        decoder,
        [mask_id] * 64,
        widths=widths,
        repeats=rounds,
        filler=mask_id,
        ar_filler=loaded.eos_ids[0],
        batch=batch,
        before=before,
    )
    try:
        curve.save(path, key=key)
    except OSError:
        pass  # a read-only cache: measure again next time
    return curve
