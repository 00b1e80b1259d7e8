"""Loading a model for the torch backend: a transformers model (a directory or a GGUF file),
its tokenizer, MARS config and mask token, an adapter with its mask-token row and gate, on the
device and in the dtype asked for (TorchModel)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...checkpoint.paths import (
    MASK_EMBEDDING_FILE,
    MASK_EMBEDDING_KEY,
    ModelError,
    check_model_path,
    load_tokenizer,
    refuse_mlx_quantized,
    resolve_model_path,
    tokenizer_path,
)
from ...core.config import MarsConfig, has_config, read_config
from ...core.tokens import eos_ids, mask_config, new_row_init
from .forward import body_and_head


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ModelError(f"device={device}: not a device (cpu, cuda, cuda:1, mps or auto)") from None
        mps = getattr(torch.backends, "mps", None)
        if (dev.type == "cuda" and not torch.cuda.is_available()) or (
            dev.type == "mps" and not (mps and mps.is_available())
        ):
            raise ModelError(f"device={device}: not available on this machine (use cpu or auto)")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    except KeyError:
        raise ModelError(f"dtype={dtype}: choose float32, float16 or bfloat16") from None


@dataclass
class TorchModel:
    """A loaded causal LM with what MARS needs to drive it."""

    model: torch.nn.Module  # a transformers *ForCausalLM (LoRA merged for inference)
    tokenizer: object
    mars: MarsConfig | None
    path: str
    device: torch.device
    dtype: torch.dtype
    gate: object = None  # a gated adapter's gate: DecodeGate loaded for decoding, MaskGate for training
    backend = "torch"  # the mars.backends module that loaded it

    @property
    def body(self) -> torch.nn.Module:
        return body_and_head(self.model)[0]

    @property
    def head(self) -> torch.nn.Module:
        return body_and_head(self.model)[1]

    @property
    def vocab_rows(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def number_format(self) -> str:
        """The dtype the model computes in: "float32", "bfloat16" or "float16"."""
        return str(self.dtype).rsplit(".", 1)[-1]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        gen = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        return eos_ids(self.tokenizer, gen)

    @property
    def context_length(self) -> int | None:
        """The model's position limit, when its config states one."""
        value = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return value if isinstance(value, int) and value > 0 else None


def load_hf_model(path: Path, *, dtype: torch.dtype, device: torch.device):
    """A transformers model from a directory or a GGUF file (dequantized), with sdpa attention."""
    from transformers import AutoModelForCausalLM

    check_model_path(path)
    refuse_mlx_quantized(path)
    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    try:
        if path.is_file():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
            check_architecture(path, getattr(model.config, "model_type", None))
            # The weights are dequantized; drop the GGUF marker so the model saves like any other.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        if isinstance(e, ModelError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{path}: could not load the model ({first})") from None
    return model.to(device).eval()


def ensure_mask_token(
    model, tokenizer, mars: MarsConfig | None, *, block_size: int = MarsConfig.block_size, exclude=(), announce=print
):
    """Return a MarsConfig whose mask token exists in `tokenizer` and `model` (the choice is
    mars.core.tokens.mask_config's; a token it adds grows the embedding by one row)."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    exclude = set(eos_ids(tokenizer, gen_eos)) | set(exclude)
    mars = mask_config(tokenizer, mars, block_size=block_size, exclude=exclude, announce=announce)
    emb = model.get_input_embeddings()
    if mars.mask_token_id >= emb.weight.shape[0]:
        old = emb.weight.shape[0]
        model.resize_token_embeddings(mars.mask_token_id + 1, mean_resizing=False)
        inp, head = model.get_input_embeddings().weight, model.get_output_embeddings()
        with torch.no_grad():  # the new rows start as mars.core.tokens.new_row_init says
            inp[old:] = inp[:old].mean(0)
            if head is not None and head.weight is not inp and new_row_init(output_head=True) == "zeros":
                head.weight[old:] = 0
                if getattr(head, "bias", None) is not None:
                    head.bias[old:] = 0
    return mars


def check_architecture(path: Path, arch: str | None = None) -> None:
    """Refuse a model whose architecture is outside the table (mars.checkpoint.architectures):
    a directory before any work, from its config.json; a GGUF file once transformers has read
    it (`arch`, its model_type)."""
    from ...checkpoint.architectures import model_type, refusal

    arch = arch or (model_type(path) if path.is_dir() else None)
    refused = refusal(arch, path if path.is_file() else f"{path}/config.json", "torch") if arch is not None else None
    if refused:
        raise ModelError(refused)


def load_mask_embedding(adapter_dir: Path):
    from safetensors.torch import load_file

    f = adapter_dir / MASK_EMBEDDING_FILE
    return load_file(str(f))[MASK_EMBEDDING_KEY] if f.is_file() else None


def load(
    model_path=None,
    *,
    adapter_path=None,
    dtype: str | None = None,
    device: str | None = None,
    merge: bool = True,
    announce=print,
) -> TorchModel:
    """Load a model for decoding or training: HF dir, GGUF file, adapter dir, or None (embedded default)."""
    base_path, adapter = resolve_model_path(model_path, adapter_path)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    check_model_path(base_path)
    check_architecture(base_path)
    source = adapter if adapter is not None else base_path
    tokenizer = load_tokenizer(tokenizer_path(base_path, adapter))
    model = load_hf_model(base_path, dtype=dt, device=dev)
    mars = None
    cfg_dir = source if source.is_dir() else None
    if cfg_dir is not None and has_config(cfg_dir):
        mars = read_config(cfg_dir)
        ensure_mask_token(model, tokenizer, mars, announce=announce)
    if adapter is not None:
        from peft import PeftModel

        if not (adapter / "adapter_config.json").is_file():
            raise ModelError(f"{adapter}: no adapter_config.json (not a PEFT adapter directory)")
        gated = mars is not None and mars.gate == "masks"
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=not merge)
        if merge and not gated:  # a gated adapter cannot be merged: it acts at mask positions only
            model = model.merge_and_unload()
        row = load_mask_embedding(adapter)
        if row is not None and mars is not None:
            with torch.no_grad():
                model.get_input_embeddings().weight[mars.mask_token_id] = row.to(dt)
    model.eval()
    gate = None
    if adapter is not None and mars is not None and mars.gate == "masks":
        from .gate import MaskGate, unwrap_for_decoding

        if merge:  # decoding: the base layers alone wherever no mask is fed
            model, gate = unwrap_for_decoding(model, mars.mask_token_id)
        else:
            gate = MaskGate(model, mars.mask_token_id)
    return TorchModel(model=model, tokenizer=tokenizer, mars=mars, path=str(source), device=dev, dtype=dt, gate=gate)
