"""MARS fine-tuning on MLX: full or LoRA (mlx-lm's LoRA layers and adapter format), AdamW,
warmup + cosine, accumulation, validation, atomic checkpoints, exact resume.

Mirrors mars/backends/torch/train.py: the same batches, schedule, history records,
checkpoint cadence and output layout, so that either backend's output reads the same.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from mlx import nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ...checkpoint.architectures import FUSED_LORA_TARGETS
from ...checkpoint.hf_config import rope_overrides
from ...checkpoint.paths import MASK_EMBEDDING_FILE, MASK_EMBEDDING_KEY, portable_ref
from ...core.config import MarsConfig, write_config
from ...core.files import atomic_dir
from ...core.train.loop import (
    CHECKPOINT,
    LORA_TARGETS,
    TRAINING_LOG,
    TrainSettings,
    lr_lambda,
    run,
    total_steps,
    validation_losses,
    write_history,
)
from .forward import body, embed_tokens
from .load import MlxModel, MlxModelError, quantize_mask_row, set_mask_row
from .loss import loss_inputs, mars_losses

TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
ADAPTER_FILE = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class _Trainable(nn.Module):
    """The model plus, under LoRA, the mask token's own embedding row: one tree for
    `nn.value_and_grad` and the optimizer."""

    def __init__(self, model: nn.Module, mask_row: mx.array | None):
        super().__init__()
        self.model = model
        if mask_row is not None:
            self.mask_row = mask_row


def _quantized(module: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in module.named_modules())


def lora_keys(model: nn.Module) -> list[str]:
    """Module paths inside a decoder layer (e.g. 'self_attn.q_proj') of the usual LoRA targets."""
    first = body(model).layers[0]
    return sorted(
        name
        for name, m in first.named_modules()
        if name.rsplit(".", 1)[-1] in LORA_TARGETS + FUSED_LORA_TARGETS
        and isinstance(m, (nn.Linear, nn.QuantizedLinear))
    )


def cpu_warning() -> str | None:
    """A one-line warning when MLX computes on the CPU (Linux's build, or no Metal), where it
    trains far slower than the torch backend; None on the GPU."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return None
    why = "" if mx.metal.is_available() else " (no Metal)"
    return (
        f"warning: MLX is running on the CPU{why}: training is much slower here than --backend torch "
        "(about 37x on a 2-core CPU)"
    )


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


class MlxTrainer:
    def __init__(
        self, loaded: MlxModel, mars: MarsConfig, settings: TrainSettings, output: Path, *, announce=_to_stderr
    ):
        from mlx_lm.tuner.utils import linear_to_lora_layers

        slow = cpu_warning()
        if slow and mx.distributed.init().rank() == 0:
            announce(slow)
        self.loaded, self.mars, self.s, self.output = loaded, mars, settings, Path(output)
        model = loaded.model
        self.model = model
        mx.random.seed(settings.seed)
        emb = embed_tokens(model)
        self._emb_dtype = emb(mx.array([0])).dtype
        mask_row = None
        if settings.fine_tune_type == "lora":
            keys = lora_keys(model)
            if not keys:
                raise ValueError("LoRA: none of the usual projection layers found; use fine_tune_type full")
            self.num_layers = len(body(model).layers)
            self.lora_parameters = {
                "rank": settings.lora_rank,
                "scale": settings.lora_alpha / settings.lora_rank,
                "dropout": settings.lora_dropout,
                "keys": keys,
            }
            init = None
            if settings.init_adapter:
                from .load import mlx_adapter

                # A PEFT adapter is converted once (into the cache); its rank, scale and layers rule.
                init = mlx_adapter(Path(settings.init_adapter), Path(loaded.path), announce=lambda m: None)
                config = json.loads((init / "adapter_config.json").read_text())
                self.num_layers = int(config["num_layers"])
                self.lora_parameters = dict(config["lora_parameters"])
            model.freeze()
            linear_to_lora_layers(model, self.num_layers, self.lora_parameters)
            if init is not None:
                weights = mx.load(str(init / "adapters.safetensors"))
                known = {k for k, _ in tree_flatten(model.parameters())}
                stray = sorted(k for k in weights if k not in known)
                if stray:
                    raise MlxModelError(f"{settings.init_adapter}: adapter weights {stray[:3]} do not fit this model")
                model.load_weights(list(weights.items()), strict=False)
                row = mx.load(str(Path(settings.init_adapter) / MASK_EMBEDDING_FILE))[MASK_EMBEDDING_KEY]
            else:
                row = emb(mx.array([mars.mask_token_id]))[0]
            mask_row = row.astype(mx.float32)
        elif settings.fine_tune_type == "full":
            if _quantized(model):
                raise MlxModelError(
                    "full fine-tuning needs a float model, not a quantized one; use fine_tune_type lora"
                )
            model.unfreeze()
        else:
            raise ValueError(f"fine_tune_type must be lora or full, got {settings.fine_tune_type!r}")
        self.gate = None
        if settings.gate == "masks":
            from .gate import MlxMaskGate

            self.gate = MlxMaskGate(model, mars.mask_token_id)
        model.train()
        self.net = _Trainable(model, mask_row)
        mx.eval(self.net.parameters())
        self.trainable = sum(v.size for _, v in tree_flatten(self.net.trainable_parameters()))
        # torch.optim.AdamW corrects the moment estimates' bias; mlx's AdamW does so only when asked.
        self.opt = optim.AdamW(
            learning_rate=settings.learning_rate, weight_decay=settings.weight_decay, bias_correction=True
        )
        self._value_and_grad = nn.value_and_grad(self.net, self._loss)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.history: list[dict] = []
        self.pad_id = loaded.tokenizer.eos_token_id
        self.total = 0

    # -- the loss ----------------------------------------------------------
    def _batch(self, batch, training: bool = True) -> dict:
        """The arrays of a batch: in training with the settings' slot weights; in validation
        (`training` False) without, so runs with different settings validate alike."""
        ids, labels, lengths = batch
        return loss_inputs(
            ids,
            labels,
            lengths,
            self.mars.block_size,
            self.mars.mask_token_id,
            self.s.normalize,
            slot_weights=self.s.slot_weights if training else (),
        )

    def _losses(self, arrays: dict, training: bool = True):
        distill = (self.s.distill_temperature, self.s.distill_mix) if self.s.objective == "distill" else None
        return mars_losses(
            self.net.model,
            arrays,
            mask_row=self.mask_row,
            mask_id=self.mars.mask_token_id,
            gate=self.gate,
            distill=distill,
            consistency=self.s.consistency if training else 0.0,
        )

    def _loss(self, arrays: dict):
        noisy, clean = self._losses(arrays)
        return noisy + self.s.ar_weight * clean, (noisy, clean)

    # -- checkpoints -------------------------------------------------------
    def _trainable_state(self) -> dict:
        return dict(tree_flatten(self.net.trainable_parameters()))

    def save_checkpoint(self) -> None:
        if mx.distributed.init().rank() != 0:
            return

        def write(d: Path):
            mx.save_safetensors(str(d / TRAINABLE_FILE), self._trainable_state())
            mx.save_safetensors(str(d / OPTIMIZER_FILE), dict(tree_flatten(self.opt.state)))
            state = {
                "step": self.step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "history": self.history,
                "settings": asdict(self.s),
            }
            (d / STATE_FILE).write_text(json.dumps(state))

        atomic_dir(self.output / CHECKPOINT, write)

    def load_checkpoint(self) -> bool:
        d = self.output / CHECKPOINT
        if not (d / STATE_FILE).is_file():
            return False
        weights = mx.load(str(d / TRAINABLE_FILE))
        expected = self._trainable_state()
        if set(weights) != set(expected):
            raise ValueError(f"{d}: the checkpoint's trainable parameters do not match this run's (other settings?)")
        self.net.update(tree_unflatten(list(weights.items())))
        self.opt.state = tree_unflatten(list(mx.load(str(d / OPTIMIZER_FILE)).items()))
        mx.eval(self.net.parameters(), self.opt.state)
        meta = json.loads((d / STATE_FILE).read_text())
        self.step, self.epoch, self.batch_in_epoch = meta["step"], meta["epoch"], meta["batch_in_epoch"]
        self.history = meta["history"]
        return True

    # -- the loop ----------------------------------------------------------
    def evaluate(self, examples, *, progress: bool = False) -> dict:
        if not examples:
            return {}
        self.net.eval()

        def losses(batch):
            a, b = self._losses(self._batch(batch, training=False), training=False)
            mx.eval(a, b)
            return a.item(), b.item()

        result = validation_losses(examples, self.s, self.pad_id, losses, self.mars.ar_weight, progress=progress)
        self.net.train()
        return result

    def average(self, values: list[float]) -> list[float]:
        # Gathered and averaged in Python's float64, as one process adds up its micro-batches.
        rows = mx.distributed.all_gather(mx.array([values], dtype=mx.float32), group=self._group).tolist()
        return [sum(column) / self._world for column in zip(*rows)]

    def accumulate(self, batch, first: bool) -> tuple[float, float]:
        if first:
            # Dropout draws depend on the step only, so a resumed run draws the same.
            mx.random.seed(self.s.seed * 1_000_003 + self.step)
        (_, (noisy, clean)), g = self._value_and_grad(self._batch(batch))
        g = tree_map(lambda x: x / self.s.grad_accumulation, g) if self.s.grad_accumulation > 1 else g
        self._grads = g if first else tree_map(mx.add, self._grads, g)
        mx.eval(self._grads, noisy, clean)
        return noisy.item(), clean.item()

    def apply_update(self) -> float:
        grads, self._grads = self._grads, None
        if self._world > 1:
            grads = tree_map(lambda x: mx.distributed.all_sum(x, group=self._group) / self._world, grads)
        if self.s.max_grad_norm:
            grads, _ = optim.clip_grad_norm(grads, self.s.max_grad_norm)
        # The torch trainer's LambdaLR: step k runs at learning_rate * schedule(k).
        self.opt.learning_rate = self.s.learning_rate * self._schedule(self.step)
        self.opt.update(self.net, grads)
        mx.eval(self.net.parameters(), self.opt.state)
        return self.s.learning_rate * self._schedule(self.step + 1)

    def train(self, train_examples, valid_examples=(), *, resume: bool = False, log=print, progress=True) -> dict:
        # Several processes (`mlx.launch`): each takes every world-th batch; gradients are averaged.
        self._group = mx.distributed.init()
        self._world = self._group.size()
        self.total, warmup = total_steps(len(train_examples), self.s, self._world)
        self._schedule = lr_lambda(self.total, warmup)
        self.net.train()
        result = run(
            self,
            train_examples,
            valid_examples,
            total=self.total,
            rank=self._group.rank(),
            world=self._world,
            resume=resume,
            log=log,
            progress=progress,
        )
        self.net.eval()
        return result

    # -- output ------------------------------------------------------------
    @property
    def mask_row(self) -> mx.array | None:
        return self.net.mask_row if "mask_row" in self.net else None

    def _base_config(self) -> dict:
        """The model's config.json for a full-model output, with what mlx-lm needs to read it back."""
        from mlx_lm.utils import load_config

        source = Path(self.loaded.path)
        if (source / "config.json").is_file():
            config = load_config(source)
        else:  # loaded through an adapter directory: the model's own arguments
            config = {k: v for k, v in asdict(self.model.args).items() if v is not None}
        config.update(rope_overrides(config))
        config["vocab_size"] = int(embed_tokens(self.model).weight.shape[0])
        return config

    def _adapter_config(self, base_ref: str) -> dict:
        """The fields mlx-lm's `lora` writes (and `load_adapters` reads) for a LoRA adapter."""
        s = self.s
        named = portable_ref(base_ref)  # a local path stays in mars.json only
        return {
            **({"model": named} if named else {}),
            "fine_tune_type": "lora",
            "num_layers": self.num_layers,
            "lora_parameters": self.lora_parameters,
            "optimizer": "adamw",
            "optimizer_config": {"adamw": {"weight_decay": s.weight_decay}},
            "seed": s.seed,
            "batch_size": s.batch_size,
            "iters": self.total or s.iters,
            "learning_rate": s.learning_rate,
            "grad_accumulation_steps": s.grad_accumulation,
            "steps_per_eval": s.steps_per_eval,
            "save_every": s.steps_per_save,
            "adapter_path": str(self.output),
        }

    def _save_full(self, d: Path, fuse_lora: bool) -> None:
        from mlx_lm.utils import save_config, save_model

        model = self.model
        originals, old_table = [], None
        try:
            if fuse_lora:
                # As mlx_lm.fuse: every LoRA layer becomes a plain (or quantized) linear.
                fused = []
                for name, m in model.named_modules():
                    if hasattr(m, "fuse"):
                        originals.append((name, m))
                        fused.append((name, m.fuse()))
                if fused:
                    model.update_modules(tree_unflatten(fused))
                emb = embed_tokens(model)
                old_table = {k: emb[k] for k in ("weight", "scales", "biases") if emb.get(k) is not None}
                place = quantize_mask_row if isinstance(emb, nn.QuantizedEmbedding) else set_mask_row
                place(model, self.mars.mask_token_id, self.mask_row)
            save_model(d, model)
        finally:
            if originals:
                model.update_modules(tree_unflatten(originals))
            if old_table is not None:
                embed_tokens(model).update(old_table)
        save_config(self._base_config(), d / "config.json")
        generation = Path(self.loaded.path) / "generation_config.json"
        if generation.is_file():
            shutil.copy(generation, d / "generation_config.json")

    def save(self, tokenizer, base_ref: str, *, fuse: bool = False) -> Path:
        """Write the MARS checkpoint into the output directory (atomically) and drop the resume checkpoint.

        LoRA: an mlx-lm adapter directory (adapters.safetensors, adapter_config.json) plus the
        trained mask-token row; full fine-tuning, or LoRA with fuse=True: a whole mlx-lm model."""
        from mlx_lm.utils import save_config

        from ...core.config import GATED_FUSE_REFUSED

        if fuse and self.s.gate == "masks":
            raise ValueError(GATED_FUSE_REFUSED)
        self.mars.base_model = base_ref
        self.mars.ar_weight = self.s.ar_weight
        self.mars.gate = self.s.gate if self.s.fine_tune_type == "lora" else "none"
        self.net.eval()
        if mx.distributed.init().rank() != 0:
            return self.output

        def write(d: Path):
            if self.s.fine_tune_type == "lora" and not fuse:
                mx.save_safetensors(str(d / ADAPTER_FILE), dict(tree_flatten(self.model.trainable_parameters())))
                save_config(self._adapter_config(base_ref), d / ADAPTER_CONFIG)
                row = self.mask_row.astype(self._emb_dtype)
                mx.save_safetensors(str(d / MASK_EMBEDDING_FILE), {MASK_EMBEDDING_KEY: row})
            else:
                self._save_full(d, fuse_lora=self.s.fine_tune_type == "lora")
            tokenizer.save_pretrained(str(d))
            write_config(self.mars, d)
            write_history(self.history, d / TRAINING_LOG)

        atomic_dir(self.output, write)
        return self.output
