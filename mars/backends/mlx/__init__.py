"""MLX backend: mlx-lm models with explicit positions and masks; mlx-lm LoRA."""

from .decode import MlxDecoder
from .load import MlxModel, MlxModelError, ensure_mask_token, load
from .loss import losses

__all__ = ["MlxDecoder", "MlxModel", "MlxModelError", "ensure_mask_token", "load", "losses"]
