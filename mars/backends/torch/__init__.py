"""PyTorch backend: transformers models on CPU, CUDA or MPS; peft LoRA; accelerate for many GPUs."""

from .decode import TorchDecoder
from .load import TorchModel, ensure_mask_token, load
from .loss import losses

__all__ = ["TorchDecoder", "TorchModel", "ensure_mask_token", "load", "losses"]
