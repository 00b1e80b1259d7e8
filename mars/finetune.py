"""Fine-tuning with the MARS objective as one call: what `mars finetune` does once its options
are parsed. It checks the settings, reads the data (docs/method.md §2), loads the base model
through the backend contract (mars.backends.base), readies the mask token (§1), trains with
the backend's trainer (§3, §4) and saves the checkpoint with its mars.json (§7).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from .backends import base
from .core.acceptance import ThresholdError, check_threshold
from .core.config import GATED_FUSE_REFUSED, ConfigError, has_config, read_config
from .core.decode.rules import DEFAULT_METRIC
from .core.files import OutputError, check_output, restore_swapped_dir
from .core.loss import check_slot_weights
from .core.train.loop import CHECKPOINT, GATE_NEEDS_LORA, TrainSettings, process_rank

# The most tokens of training data `finetune` keeps as the checkpoint's draft corpus (about
# 100 bytes of memory a token once decoding indexes it).
CORPUS_TOKENS = 4_000_000


class FinetuneError(ValueError):
    """Settings that cannot train together; `setting` names the one to change (a TrainSettings
    field or an argument of `finetune`)."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


def finetune(
    data,
    output,
    *,
    model=None,
    backend: str = "auto",
    dtype: str = "auto",
    device: str = "auto",
    max_seq_length: int = 512,
    on_long: str = "error",
    resume: bool = False,
    default_threshold: float = 0.9,
    default_mode: str = "threshold",
    fuse: bool = False,
    init_adapter=None,
    draft_corpus: bool = True,
    announce=print,
    **train,
) -> dict:
    """Fine-tune `model` (a base model; None: the embedded default) on `data` (a directory with
    train.jsonl and optionally valid.jsonl, or one .jsonl file) into `output`.

    `train` holds TrainSettings fields. Without `block_size`, a run from `init_adapter` keeps
    the adapter's block size, any other the default. `default_threshold` and `default_mode` are
    written to mars.json: how decoding runs the checkpoint when asked for no threshold. `fuse`
    (LoRA) writes the adapter fused into a full model. `draft_corpus` also writes the training
    split as the checkpoint's draft corpus (mars.core.decode.drafts.corpus, at most CORPUS_TOKENS tokens),
    which lossless decoding drafts from. Returns the trainer's result ("steps", "seconds",
    "history") with "output" and "main" (False in the processes other than rank 0 of a run
    launched by torchrun, accelerate launch or mlx.launch: they write and announce nothing)."""
    from .checkpoint.default_model import model_ref
    from .checkpoint.paths import ModelError, check_model_path, load_tokenizer, resolve_model_path
    from .core.train.data import find_split_file, load_split

    name = base.resolve(backend)
    output = Path(output)
    main = process_rank() == 0
    if not main:
        announce = _silent
    block_size = train.pop("block_size", None)
    kind = train.get("fine_tune_type", TrainSettings.fine_tune_type)
    gate = train.get("gate", TrainSettings.gate)
    if (block_size or TrainSettings.block_size) < 1:
        raise FinetuneError("block_size", "must be >= 1")
    if max_seq_length < (block_size or TrainSettings.block_size):
        raise FinetuneError(
            "max_seq_length", f"must be at least one block (block size {block_size or TrainSettings.block_size})"
        )
    if fuse and kind != "lora":
        raise FinetuneError("fuse", "only applies to fine_tune_type lora")
    if gate != "none" and kind != "lora":
        raise FinetuneError("gate", GATE_NEEDS_LORA)
    if fuse and gate == "masks":
        raise FinetuneError("fuse", GATED_FUSE_REFUSED)
    val_batches = train.get("val_batches", TrainSettings.val_batches)
    if val_batches == 0 or val_batches < -1:
        raise FinetuneError("val_batches", "must be -1 (the whole validation set) or at least 1")
    restore_swapped_dir(output)  # a run killed while it swapped in its output
    restore_swapped_dir(output / CHECKPOINT)
    if not resume:
        check_output(
            output, sources=(data, model, init_adapter), fix="pass --resume to continue it, or choose a new --output"
        )
    elif not (output / CHECKPOINT).is_dir():
        raise OutputError(f"{output}: no checkpoint to resume from")

    base_path, adapter = resolve_model_path(model, weights=False)  # no model: train the plain base
    if adapter is not None:
        raise ModelError(
            f"{model}: is an adapter; fine-tune from its base model (or a fused model), or pass it as --init-adapter"
        )
    check_model_path(base_path)
    init = None
    if init_adapter is not None:
        init, block_size, train["lora_rank"], train["lora_alpha"] = read_init_adapter(
            init_adapter, base_path, kind, block_size, announce
        )
    block_size = block_size or TrainSettings.block_size
    try:
        train["slot_weights"] = check_slot_weights(train.get("slot_weights", ()), block_size)
    except ValueError as e:
        raise FinetuneError("slot_weights", str(e)) from None
    try:
        check_threshold(
            init.metric if init is not None else DEFAULT_METRIC, default_threshold, name="the default threshold"
        )
    except ThresholdError as e:
        raise FinetuneError("default_threshold", str(e)) from None

    tokenizer = load_tokenizer(base_path)
    read = functools.partial(
        load_split, tokenizer=tokenizer, block_size=block_size, max_seq_length=max_seq_length, on_long=on_long
    )
    splits = {"train": read(data, "train"), "valid": read(data, "valid") if find_split_file(data, "valid") else None}
    for split in splits.values():
        if split is not None and (split.truncated or split.skipped):
            announce(
                f"{split.path}: {split.truncated} truncated, {split.skipped} skipped over --max-seq-length "
                f"{max_seq_length}"
            )
    train_split, valid = splits["train"], splits["valid"]
    announce(
        f"data: {len(train_split.examples)} train" + (f", {len(valid.examples)} valid" if valid else "") + " examples"
    )

    if name == "torch" and dtype in (None, "auto") and kind == "full":
        dtype = "float32"  # trained weights stay float32; CUDA runs the forward under bfloat16 autocast
    loaded = base.load(name, base_path, dtype=dtype, device=device, announce=announce)
    mars = (
        dataclasses.replace(init, block_size=block_size)
        if init is not None
        else loaded.mars
        if has_config(base_path)
        else None
    )
    if mars is not None and mars.block_size != block_size:
        raise ConfigError(
            f"{base_path / 'mars.json'}: block_size {mars.block_size} differs from --block-size {block_size}"
        )
    mars = base.ensure_mask_token(loaded, mars, block_size=block_size, announce=announce)
    settings = TrainSettings(**train, block_size=block_size, init_adapter=str(init_adapter) if init is not None else "")
    trainer = base.trainer(name)(loaded, mars, settings, output)
    announce(
        f"training {settings.fine_tune_type} ({trainer.trainable:,} trainable parameters), B={settings.block_size}, "
        f"ar_weight={settings.ar_weight}, on {loaded.device}"
    )
    result = trainer.train(train_split.examples, valid.examples if valid else (), resume=resume, log=announce)
    mars.default_threshold = default_threshold
    mars.default_mode = default_mode
    trainer.save(loaded.tokenizer, model_ref(base_path), fuse=fuse)
    if draft_corpus and main:
        from .core.decode.drafts import corpus

        built = corpus.from_data(data, tokenizer, announce=announce, max_tokens=CORPUS_TOKENS)
        built.save(output / corpus.FILE)
        announce(f"draft corpus: {len(built):,} tokens -> {output / corpus.FILE}")
    close = getattr(trainer, "close", None)  # the torch trainer ends its process group under a launcher
    if close is not None:
        close()
    return {**result, "output": output, "main": main}


def _silent(message: str) -> None:
    pass


def read_init_adapter(path, base_path: Path, kind: str, block_size: int | None, announce=print):
    """(MarsConfig, block size, LoRA rank, LoRA alpha) of a MARS adapter to start LoRA from,
    after checking it fits this run: its block size unless `block_size` names another, its rank
    and alpha (they are what will train)."""
    from .checkpoint.adapters import adapter_format, read_adapter
    from .checkpoint.default_model import model_ref
    from .checkpoint.paths import MASK_EMBEDDING_FILE, ModelError
    from .checkpoint.tensors import ConvertError

    path = Path(path)
    where = f"--init-adapter {path}"
    if kind != "lora":
        raise FinetuneError(
            "init_adapter", "only applies to fine_tune_type lora (a full fine-tune starts from the model itself)"
        )
    try:
        fmt = adapter_format(path)
    except ConvertError as e:
        raise ModelError(f"{where}: {e}") from None
    if fmt is None:
        raise ModelError(
            f"{where}: not an adapter directory (adapter_config.json with adapter weights, no config.json)"
        )
    if not has_config(path):
        raise ModelError(f"{where}: no mars.json (not a MARS adapter: its mask row and block size are unknown)")
    mars = read_config(path)
    if not (path / MASK_EMBEDDING_FILE).is_file():
        raise ModelError(f"{where}: no {MASK_EMBEDDING_FILE} (the trained mask-token row)")
    if mars.base_model and mars.base_model != model_ref(base_path):
        raise ModelError(
            f"{where}: trained on {mars.base_model}, not on {model_ref(base_path)}; pass --model {mars.base_model}"
        )
    if block_size is None:
        block_size = mars.block_size
    elif block_size != mars.block_size:
        # The masks do not depend on B: the j-th mask of a window predicts slot j whatever B is, so
        # a block size change keeps what the slots both sizes share learnt (a smaller B trains
        # those slots on more examples per token; a larger one starts the new slots from scratch).
        announce(
            f"--init-adapter: its block size {mars.block_size} becomes {block_size}; the masks keep slots 1-"
            f"{min(mars.block_size, block_size)}"
        )
    lora = read_adapter(path)
    return mars, block_size, lora.rank, lora.scale * lora.rank
