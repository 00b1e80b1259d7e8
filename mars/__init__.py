"""mars: Mask AutoRegression fine-tuning and multi-token decoding for causal language models."""

__version__ = "0.1.0"
