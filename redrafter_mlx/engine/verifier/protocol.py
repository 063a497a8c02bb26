"""The verifier's interface: the one type every other part of the engine names.

There is one implementation, ``lm_model.LmModel`` (any text model mlx-lm builds, its own
class doing the forward); the engine, the draft sources, training and the tools type their
arguments with :class:`Verifier` and rely on nothing else:

* ``__call__(tokens, positions, mask, cache, write_idx, fresh=None, counts=None)``:
  one forward over T new tokens per row against the slot cache, each token at its own
  position; returns (hidden (B, T, state_width), the cache after it): a cache is a
  tuple of typed entries (``entries.Slots`` per attention cache, ``entries.State`` per
  recurrent layer);
* ``logits(hidden)``, ``head_logits(hidden, ids)``, ``head_rows(ids)``: the model's own head;
* ``run_to(..., stop)``: the residual after its first ``stop`` layers (an early exit);
* ``embed``, ``make_cache``, ``hidden_size``, ``vocab_size``, ``dtype``, ``args``, ``layers``;
* what this base class keeps beside the forward: the feature layers a draft source reads
  (``capture_features``) and the context cap.

Shapes: B batch rows, T new tokens, S cache slots, H hidden size, V vocabulary.
"""

from __future__ import annotations

import mlx.nn as nn


class Verifier(nn.Module):
    """What every verifier keeps beside its forward: the feature layers a drafter reads and
    the context cap. A subclass sets ``args`` (``num_hidden_layers``,
    ``max_position_embeddings``) and ``hidden_size``, and starts ``feature_layers`` empty."""

    def capture_features(self, layers) -> None:
        """Make every forward also return the residual stream entering each of ``layers``
        (a drafter's ``feature_layers``; empty: the final normed hidden state alone).

        The forward's hidden output becomes (..., (1 + k) * H): the final normed hidden
        state (what ``logits`` reads) followed by the k captured residuals, in ``layers``
        order, so every path that keeps a hidden state for the drafter (prefill, the AR
        step, the tree verify's accepted node, batch rows) keeps the features with it, from
        the same forward. Compiled steps traced for another width are dropped.
        """
        layers = tuple(int(i) for i in layers or ())
        n = self.args.num_hidden_layers
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"feature layers {bad} are outside this model's layers [0, {n})")
        if layers != self.feature_layers:
            self.__dict__.pop("_batch_steps", None)
        self.feature_layers = layers

    @property
    def state_width(self) -> int:
        """Width of the hidden output of ``__call__``: H, or (1 + k) * H with k captured
        feature layers (``capture_features``)."""
        return self.hidden_size * (1 + len(self.feature_layers))

    @property
    def max_context(self) -> int | None:
        """Most tokens a row may hold: the model's trained context, or less after
        ``cap_context`` (every loop, chat and the server stop or trim at this one figure)."""
        trained = self.args.max_position_embeddings
        cap = getattr(self, "context_cap", None)
        if cap is None:
            return trained
        return cap if trained is None else min(trained, cap)

    def cap_context(self, tokens: int | None) -> None:
        """Hold at most ``tokens`` per row in the KV cache (``--max-kv-size``); None lifts it."""
        if tokens is not None and tokens < 1:
            raise ValueError(f"a context cap must be >= 1 token, got {tokens}")
        self.context_cap = tokens
