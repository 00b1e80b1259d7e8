"""`mars convert`: models and adapters between Hugging Face, mlx-lm and GGUF, exactly.

    convert_model(src, output, to="hf"|"mlx", dtype=None, q_bits=None, q_group_size=64, adapter=None)
    convert_adapter(src, output, to="hf"|"mlx", base=None)
    convert_vllm(src, output)  a MARS checkpoint as a vLLM parallel drafter (mars.convert.vllm)

Tensor I/O is safetensors + numpy (bfloat16 kept as its bit pattern), so HF <-> MLX needs neither
torch nor mlx; only quantizing (-q) uses mlx and GGUF import uses transformers. Errors are
ConvertError (a ValueError) with a one-line message; nothing is written on failure.
"""

from ..checkpoint.adapters import adapter_format, convert_adapter, read_adapter
from ..checkpoint.tensors import ConvertError, Tensor, read_safetensors, write_safetensors
from .models import SUPPORTED, convert_model, import_gguf
from .vllm import convert_vllm

__all__ = [
    "SUPPORTED",
    "ConvertError",
    "Tensor",
    "adapter_format",
    "convert_adapter",
    "convert_model",
    "convert_vllm",
    "import_gguf",
    "read_adapter",
    "read_safetensors",
    "write_safetensors",
]
