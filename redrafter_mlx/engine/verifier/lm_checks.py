"""Load-time checks of a verifier (``lm_model.LmModel``) beyond its own: what the engine's
compiled step needs of a family's forward.

A family that reads an array's value on the host inside its forward (dbrx's MoE routing
through ``.tolist()``, gpt_bigcode's positions through ``np.arange(cache.offset)``) runs
eagerly but cannot be traced by ``mx.compile``, which every decode step is: found here, at
load, in one line, instead of inside the first step.

A recurrent model's step also commits each layer's state by running the layer again over
the accepted tokens (``lm_cache.StateCommit``), on the verify's own inputs, so the compiled
step computes what both share once. MLX 0.32's ``mx.compile`` fails on some such graphs:
one elementwise result split twice (a quantized LFM2's ``in_proj``, a quantized matmul plus
its bias, split into B, C, x by the verify and again by the commit) raises ``IndexError:
_Map_base::at`` while it simplifies the graph. Found here; such a model's commit then
computes apart from its verify (``LmModel.commit_apart``), as an uncompiled step does.
"""

from __future__ import annotations

import mlx.core as mx

from ..core.tree import arange, cache_mask, chain_mask
from .entries import committed, rows_of

HOST_READ = "during function transformations"  # MLX's message for an eval while tracing
SHARED_SPLIT = "_Map_base::at"  # MLX's compile on a result split twice (see above)


def check_compiles(model) -> None:
    """ValueError naming the family unless a two-token forward of ``model`` (an ``LmModel``),
    and a recurrent model's commit after it (a tree's too), run under ``mx.compile``, as the
    engine's step does; a commit that compiles only apart from its verify is set to
    (``commit_apart``)."""
    try:
        _compiled_forward(model)
    except IndexError as e:
        if SHARED_SPLIT not in str(e) or not model.recurrent or model.commit_apart:
            raise
        model.commit_apart = True
        _compiled_forward(model)
    except ValueError as e:
        if HOST_READ not in str(e):
            raise
        raise ValueError(
            f"model_type {model.model_type!r} reads an array's value on the host inside its "
            "forward (mlx-lm's code for it calls .tolist() or numpy on an array), which the "
            "engine's compiled decode step cannot trace; this family cannot be loaded yet "
            "(mlx_lm.generate runs it)"
        ) from None


def _compiled_forward(model) -> None:
    """A two-token forward of ``model`` and, when recurrent, the commit of its first token,
    then a recurrent model's three-node tree and its commit along a path, compiled and run
    (every array an input, as the step's are: nothing the trace may read)."""
    S = 8
    cache = model.make_cache(1, S)
    tokens = mx.array([[1, 2]], dtype=mx.int32) % model.vocab_size
    pos = arange(2)[None]
    mask = cache_mask(mx.zeros((1,), mx.int32), chain_mask(2), S)

    def forward(tokens, pos, mask, cache):  # (1, 2) -> hidden (1, 2, H), the committed cache
        fresh = []
        hidden, after = model(tokens, pos, mask, cache, pos, fresh=fresh)
        kept = mx.ones((1,), mx.int32)  # the first token (in place: no slot moves)
        return hidden, committed(after, fresh, None, kept)

    mx.eval(mx.compile(forward)(tokens, pos, mask, cache))
    if not model.recurrent or model.verifies != "tree":
        return
    # a tree too: a root and two children, the recurrent layers over its two paths as rows,
    # the commit along the second path (root and its second child)
    tree_mask = mx.array([[[True, False, False], [True, True, False], [True, False, True]]])
    paths = mx.array([[[0, 1], [0, 2]]], dtype=mx.int32)

    def tree(tokens, pos, mask, cache):  # (1, 3) -> hidden (1, 3, H), the committed cache
        fresh = []
        slots = arange(3)[None]
        hidden, after = model(tokens, pos, mask, cache, slots, fresh=fresh, paths=paths)
        path = mx.array([[0, 2]], dtype=mx.int32)
        dst = mx.array([[0, 2, 1]], dtype=mx.int32)  # the second child to slot 1, else junk
        return hidden, committed(after, fresh, dst, mx.full((1,), 2, mx.int32), path)

    tokens = mx.array([[1, 2, 3]], dtype=mx.int32) % model.vocab_size
    pos = mx.array([[0, 1, 1]], dtype=mx.int32)
    mask = cache_mask(mx.zeros((1,), mx.int32), tree_mask, S)
    mx.eval(mx.compile(tree)(tokens, pos, mask, cache))


def check_parity(model) -> None:
    """ValueError naming the family unless a prompt through the engine's slot caches (junk
    in every slot past it, as a step leaves rejected drafts there) gives the logits of
    mlx-lm's own forward over its own caches: a family that reads its cache's keys some way
    the engine's mask does not reach (phi3small's block-sparse layers add the mask to the
    scores as numbers) would decode other tokens than mlx-lm, plainly or speculating."""
    from mlx_lm.models.cache import make_prompt_cache

    S, V = 16, model.vocab_size
    prompt = mx.array([[(7 * i + 3) % V for i in range(5)]])
    T = prompt.shape[1]
    noise = mx.random.key(0)  # a recurrent state starts at zero anyway at position 0
    cache = rows_of(model.make_cache(1, S), lambda a: _junk(a, noise))
    pos = arange(T)[None]
    mask = cache_mask(mx.zeros((1,), mx.int32), chain_mask(T), S)
    hidden, _ = model(prompt, pos, mask, cache, pos)
    got = model.logits(hidden[0])
    want = model.lm(prompt, cache=make_prompt_cache(model.lm))[0].astype(got.dtype)
    same = got == want  # -inf where a family masks a token (equal): not a difference
    off = float(mx.where(same, 0.0, mx.abs(got - want)).max())
    scale = float(mx.where(same, 0.0, mx.abs(want)).max())
    tol = (1e-4 if model.dtype == mx.float32 else 3e-2) * max(1.0, scale)
    if not off <= tol:  # NaN too
        raise ValueError(
            f"model_type {model.model_type!r} gives other logits through the engine's slot "
            f"caches than through mlx-lm's own (by {off:.3g} at load): its code reads the "
            "cache in a way the engine's attention mask does not reach; this family cannot "
            "be loaded yet (mlx_lm.generate runs it)"
        )


def _junk(buffer: mx.array, key) -> mx.array:
    """``buffer`` filled with random values (what unused slots may hold)."""
    return mx.random.normal(buffer.shape, key=key).astype(buffer.dtype)
