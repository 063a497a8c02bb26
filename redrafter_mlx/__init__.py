"""redrafter-mlx: ReDrafter speculative decoding for Llama, Mistral, Qwen2/3 and Gemma 2/3 in MLX.

The public names are imported lazily so that ``import redrafter_mlx`` (and every CLI
command's start-up) stays fast.
"""


def _version() -> str:
    """The installed distribution's version (pyproject.toml is the one source)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("redrafter-mlx")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

_EXPORTS = {
    "BeamShape": "engine.core.shape",
    "SamplerConfig": "engine.core.sampling",
    "GenerationResponse": "engine.loop.generation",
    "batch_generate": "engine.loop.generation",
    "generate": "engine.loop.generation",
    "stream_generate": "engine.loop.generation",
    "Session": "engine.decoding.cache",
    "load": "engine.loop.loading",
    "LoadError": "engine.loop.loading",
    "RedrafterError": "engine.base.errors",
    "DraftSource": "engine.drafting.sources",
    "DraftContext": "engine.drafting.sources",
    "Proposal": "engine.drafting.sources",
    "register_source": "engine.drafting.sources",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'redrafter_mlx' has no attribute {name!r}")
