"""Load-time checks of a verifier (``lm_model.LmModel``) beyond its own: what the engine's
compiled step needs of a family's forward.

A family that reads an array's value on the host inside its forward (dbrx's MoE routing
through ``.tolist()``, gpt_bigcode's positions through ``np.arange(cache.offset)``) runs
eagerly but cannot be traced by ``mx.compile``, which every decode step is: found here, at
load, in one line, instead of inside the first step.
"""

from __future__ import annotations

import mlx.core as mx

from ..core.tree import arange, cache_mask, chain_mask

HOST_READ = "during function transformations"  # MLX's message for an eval while tracing


def check_compiles(model) -> None:
    """ValueError naming the family unless a two-token forward of ``model`` (an ``LmModel``)
    runs under ``mx.compile``, as the engine's step does."""
    S = 8
    cache = model.make_cache(1, S)
    tokens = mx.array([[1, 2]], dtype=mx.int32) % model.vocab_size
    pos = arange(2)[None]
    mask = cache_mask(mx.zeros((1,), mx.int32), chain_mask(2), S)

    def forward(tokens, pos, mask, cache):  # (1, 2) -> hidden (1, 2, H)
        hidden, _ = model(tokens, pos, mask, cache, pos)
        return hidden

    try:  # every array an input, as the step's are: nothing the trace may read
        mx.eval(mx.compile(forward)(tokens, pos, mask, cache))
    except ValueError as e:
        if HOST_READ not in str(e):
            raise
        raise ValueError(
            f"model_type {model.model_type!r} reads an array's value on the host inside its "
            "forward (mlx-lm's code for it calls .tolist() or numpy on an array), which the "
            "engine's compiled decode step cannot trace; this family cannot be loaded yet "
            "(mlx_lm.generate runs it)"
        ) from None
