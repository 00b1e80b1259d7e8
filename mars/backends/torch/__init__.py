"""PyTorch backend: transformers models on CPU, CUDA or MPS; peft LoRA; accelerate for many GPUs."""

from .model import ModelError, TorchDecoder, TorchModel, load

__all__ = ["ModelError", "TorchDecoder", "TorchModel", "load"]
