"""MARS fine-tuning on PyTorch: full or LoRA, AdamW, warmup + cosine, accumulation,
validation, atomic checkpoints, resume; multi-GPU through `accelerate launch`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from ...checkpoint.architectures import FUSED_LORA_TARGETS
from ...checkpoint.hf_config import add_rope_keys
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
from .forward import model_windows
from .load import TorchModel, load_mask_embedding
from .loss import MarsLoss, loss_inputs


class TorchTrainer:
    def __init__(self, tm: TorchModel, mars: MarsConfig, settings: TrainSettings, output: Path, *, accelerator=None):
        from accelerate import Accelerator, PartialState

        self.tm, self.mars, self.s, self.output = tm, mars, settings, Path(output)
        # Under `accelerate launch` each process trains on its own device; alone, on the one asked for.
        distributed = PartialState(cpu=tm.device.type == "cpu").num_processes > 1
        self.acc = accelerator or Accelerator(cpu=tm.device.type == "cpu", device_placement=distributed)
        self.device = self.acc.device if distributed else tm.device
        if distributed:
            tm.model.to(self.device)
        # float32 weights on CUDA train under bfloat16 autocast (float32 master weights and optimizer).
        self.autocast = (
            torch.bfloat16
            if self.device.type == "cuda" and tm.dtype == torch.float32 and torch.cuda.is_bf16_supported()
            else None
        )
        torch.manual_seed(settings.seed)
        model = tm.model
        mask_row = None
        if settings.fine_tune_type == "lora" and settings.init_adapter:
            model, mask_row = _from_adapter(model, Path(settings.init_adapter), tm.path)
        elif settings.fine_tune_type == "lora":
            from peft import LoraConfig, get_peft_model

            present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
            targets = [t for t in LORA_TARGETS + FUSED_LORA_TARGETS if t in present]
            if not targets:
                raise ValueError("LoRA: none of the usual projection layers found; use fine_tune_type full")
            config = LoraConfig(
                r=settings.lora_rank,
                lora_alpha=settings.lora_alpha,
                lora_dropout=settings.lora_dropout,
                target_modules=targets,
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, config)
            emb = model.get_input_embeddings().weight
            mask_row = torch.nn.Parameter(emb[mars.mask_token_id].detach().clone().float())
        elif settings.fine_tune_type == "full":
            for p in model.parameters():
                p.requires_grad_(True)
            # Models whose pad token is EOS get an embedding that never updates that row; here
            # EOS is a real, labelled token (and padding is masked out), so it must train.
            model.get_input_embeddings().padding_idx = None
        else:
            raise ValueError(f"fine_tune_type must be lora or full, got {settings.fine_tune_type!r}")
        self.gate = None
        if settings.gate == "masks":
            from .gate import MaskGate

            self.gate = MaskGate(model, mars.mask_token_id)
        model.train()
        self.model = model
        distill = (settings.distill_temperature, settings.distill_mix) if settings.objective == "distill" else None
        self.loss = MarsLoss(model, mask_row, mars.mask_token_id, gate=self.gate, distill=distill)
        self.windows = model_windows(model)  # sliding layers: their window, cut into the MARS mask
        params = [p for p in self.loss.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.opt = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=settings.weight_decay)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.history: list[dict] = []

    # -- checkpoints -------------------------------------------------------
    def _trainable_state(self) -> dict:
        return {n: p.detach().cpu().contiguous() for n, p in self.loss.named_parameters() if p.requires_grad}

    def save_checkpoint(self) -> None:
        from safetensors.torch import save_file

        if not self.acc.is_main_process:
            return

        def write(d: Path):
            save_file(self._trainable_state(), str(d / "trainable.safetensors"))
            torch.save(
                {
                    "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(),
                    "step": self.step,
                    "epoch": self.epoch,
                    "batch_in_epoch": self.batch_in_epoch,
                    "history": self.history,
                    "settings": asdict(self.s),
                },
                d / "state.pt",
            )

        atomic_dir(self.output / CHECKPOINT, write)

    def load_checkpoint(self) -> bool:
        from safetensors.torch import load_file

        d = self.output / CHECKPOINT
        if not (d / "state.pt").is_file():
            return False
        state = load_file(str(d / "trainable.safetensors"))
        named = dict(self.loss.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                named[n].copy_(t)
        meta = torch.load(d / "state.pt", weights_only=False)
        self.opt.load_state_dict(meta["optimizer"])
        self.sched.load_state_dict(meta["scheduler"])
        self.step, self.epoch, self.batch_in_epoch = meta["step"], meta["epoch"], meta["batch_in_epoch"]
        self.history = meta["history"]
        return True

    # -- the loop ----------------------------------------------------------
    def _losses(self, batch, training: bool = True):
        """(noisy, clean) losses of a batch: in training with the slot weights and consistency
        term of the settings; in validation (`training` False) the plain objective, so runs with
        different settings report comparable validation losses."""
        ids, labels, lengths = batch
        inputs = loss_inputs(
            ids,
            labels,
            lengths,
            self.mars.block_size,
            self.mars.mask_token_id,
            self.autocast or self.tm.dtype,
            self.device,
            self.s.normalize,
            windows=self.windows,
            slot_weights=self.s.slot_weights if training else (),
        )
        if training and self.s.consistency:
            inputs["consistency"] = self.s.consistency
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            return self.loss_module(**inputs)

    @torch.no_grad()
    def evaluate(self, examples, *, progress: bool = False) -> dict:
        if not examples:
            return {}
        self.loss_module.eval()
        result = validation_losses(
            examples,
            self.s,
            self.pad_id,
            lambda batch: tuple(float(x) for x in self._losses(batch, training=False)),
            self.mars.ar_weight,
            progress=progress,
        )
        self.loss_module.train()
        return result

    def average(self, values: list[float]) -> list[float]:
        return self.acc.reduce(torch.tensor(values, dtype=torch.float64, device=self.device), reduction="mean").tolist()

    def accumulate(self, batch, first: bool) -> tuple[float, float]:
        noisy, clean = self._losses(batch)
        self.acc.backward((noisy + self.s.ar_weight * clean) / self.s.grad_accumulation)
        return noisy.item(), clean.item()

    def apply_update(self) -> float:
        if self.s.max_grad_norm:
            self.acc.clip_grad_norm_(self.loss_module.parameters(), self.s.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return self.sched.get_last_lr()[0]

    def train(self, train_examples, valid_examples=(), *, resume: bool = False, log=print, progress=True) -> dict:
        self.pad_id = self.tm.tokenizer.eos_token_id
        total, warmup = total_steps(len(train_examples), self.s, self.acc.num_processes)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(total, warmup))
        # The schedule stays outside accelerate, which would step it once per process each step.
        self.loss_module, self.opt = self.acc.prepare(self.loss, self.opt)
        return run(
            self,
            train_examples,
            valid_examples,
            total=total,
            rank=self.acc.process_index,
            world=self.acc.num_processes,
            resume=resume,
            log=log,
            progress=progress,
        )

    # -- output ------------------------------------------------------------
    def close(self) -> None:
        """Under a launcher, wait for every process and end the process group: a process that exits
        with it open while another still works (the main one writing the draft corpus) may abort in
        the group's threads ("terminate called without an active exception")."""
        if self.acc.num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            self.acc.wait_for_everyone()
            torch.distributed.destroy_process_group()

    def save(self, tokenizer, base_ref: str, *, fuse: bool = False) -> Path:
        """Write the MARS checkpoint into the output directory (atomically) and drop the resume checkpoint.

        LoRA writes a PEFT adapter plus the mask-token row; with `fuse`, one full model instead."""
        from safetensors.torch import save_file

        from ...core.config import GATED_FUSE_REFUSED
        from .gate import GateError

        if fuse and self.s.gate == "masks":
            raise GateError(GATED_FUSE_REFUSED)
        self.mars.base_model = base_ref
        self.mars.ar_weight = self.s.ar_weight
        self.mars.gate = self.s.gate if self.s.fine_tune_type == "lora" else "none"
        model = self.acc.unwrap_model(self.loss_module).model
        model.eval()
        if not self.acc.is_main_process:
            return self.output
        lora = self.s.fine_tune_type == "lora"
        row = self.loss.mask_row.detach().to(self.tm.dtype) if lora else None
        if lora and fuse:
            model = model.merge_and_unload()
            with torch.no_grad():
                model.get_input_embeddings().weight[self.mars.mask_token_id] = row

        def write(d: Path):
            model.save_pretrained(str(d))
            if lora and not fuse:
                save_file({MASK_EMBEDDING_KEY: row.cpu().contiguous()}, str(d / MASK_EMBEDDING_FILE))
                _name_base(d, portable_ref(base_ref))
            else:
                add_rope_keys(d)
            tokenizer.save_pretrained(str(d))
            write_config(self.mars, d)
            write_history(self.history, d / TRAINING_LOG)

        atomic_dir(self.output, write)
        return self.output


def _name_base(adapter: Path, base: str | None) -> None:
    """Name the base in PEFT's adapter_config.json and model card (README.md) as `base`, or
    not at all: PEFT writes the base's local path, which means nothing on another machine."""
    from huggingface_hub import ModelCard

    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = base
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
    card_file = adapter / "README.md"
    if card_file.is_file():
        card = ModelCard.load(card_file)
        card.data.base_model = base
        tags = [t for t in card.data.tags or () if not t.startswith("base_model:")]
        card.data.tags = sorted(tags + ([f"base_model:adapter:{base}"] if base else [])) or None
        card.save(card_file)


def _from_adapter(model, adapter: Path, base) -> tuple:
    """LoRA layers and mask row initialised from a MARS adapter (PEFT, or mlx-lm converted)."""
    import tempfile

    from peft import PeftModel

    from ...checkpoint.adapters import adapter_format, convert_adapter

    with tempfile.TemporaryDirectory(prefix="mars-init-") as tmp:
        source = adapter
        if adapter_format(adapter) == "mlx":
            source = convert_adapter(adapter, Path(tmp) / "peft", "hf", base=Path(base))
        model = PeftModel.from_pretrained(model, str(source), is_trainable=True)
    return model, torch.nn.Parameter(load_mask_embedding(adapter).float())
