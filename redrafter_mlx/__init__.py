"""redrafter-mlx: ReDrafter speculative decoding for Llama-family models in MLX."""

__version__ = "0.1.0"

from .generate import GenerationResponse, batch_generate, generate, stream_generate  # noqa: E402
from .loading import LoadError, load  # noqa: E402

__all__ = [
    "GenerationResponse", "LoadError", "batch_generate", "generate", "load", "stream_generate",
    "__version__",
]
