"""Drafters for tests that need drafts accepted in part and rejected in part."""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.engine.drafting.drafter import DrafterArgs


def follows(texts, vocab: int) -> list[int]:
    """Per token id, the token that first followed it in ``texts`` (0 if none), mod ``vocab``:
    the model's greedy continuation, when ``texts`` are its own greedy outputs."""
    after: dict[int, int] = {}
    for text in texts:
        for a, b in itertools.pairwise(text):
            after.setdefault(a, b)
    return [after.get(t, 0) % vocab for t in range(vocab)]


class ReplayDrafter(nn.Module):
    """A drafter that knows the model's greedy continuation: after token t it proposes the
    token that followed t in ``texts``, off by one for every ``wrong``-th id, so drafts are
    accepted in part and rejected in part (commits at every length)."""

    def __init__(self, model, texts, wrong: int = 5):
        super().__init__()
        V = model.vocab_size
        table = [(r + (t % wrong == 0)) % V for t, r in enumerate(follows(texts, V))]
        self.table = mx.array(table, dtype=mx.int32)
        self.emb = model.embed(mx.arange(V))
        self.eye = mx.eye(V) * 30.0
        mx.eval(self.table, self.emb, self.eye)
        self.args = DrafterArgs(vocab_size=V, hidden_size=model.hidden_size, exit_dim=1)

    def next_state(self, state, token_emb):
        return token_emb

    def __call__(self, hidden, state):
        token = mx.argmax(state @ self.emb.T, axis=-1)
        return self.eye[self.table[token]]
