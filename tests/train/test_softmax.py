"""The distillation loss's softmax pieces (train/softmax.py) against MLX's own ops, and the
loss against its textbook form: −Σ p log_softmax(z) where a teacher is given, CE elsewhere."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from redrafter_mlx.engine.drafting.drafter import Drafter, DrafterArgs
from redrafter_mlx.train.softmax import exp_nonpositive, logsumexp, softmax
from redrafter_mlx.train.training import drafter_loss


def test_exp_matches_mlx_exp_over_a_softmaxs_range():
    x = mx.concatenate([mx.linspace(-87.0, 0.0, 200_001), mx.array([0.0, -1e-7, -0.5])])
    want, got = mx.exp(x), exp_nonpositive(x)
    rel = mx.abs(got - want) / want
    assert mx.max(rel).item() < 5e-5
    assert exp_nonpositive(mx.array([0.0])).item() == 1.0
    below = exp_nonpositive(mx.array([-100.0, -1e30, -float("inf")]))
    assert (np.array(below) <= 1.7e-38).all() and (np.array(below) >= 0).all()


def test_logsumexp_and_its_gradient_match_mlx():
    z = mx.random.normal((6, 300), key=mx.random.key(0)) * 8
    assert mx.allclose(logsumexp(z), mx.logsumexp(z, axis=-1), rtol=1e-5, atol=1e-5).item()
    w = mx.random.normal((6,), key=mx.random.key(1))
    got = mx.grad(lambda z: (logsumexp(z) * w).sum())(z)
    want = mx.grad(lambda z: (mx.logsumexp(z, axis=-1) * w).sum())(z)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-7).item()
    # rows far apart in scale: the shift by the row maximum keeps both finite
    big = mx.array([[1000.0, 999.0, -5.0], [-1000.0, -1001.0, -1003.0]])
    assert mx.allclose(logsumexp(big), mx.logsumexp(big, axis=-1), atol=1e-4).item()


def test_softmax_matches_mlx():
    z = mx.random.normal((4, 5, 77), key=mx.random.key(2)) * 10
    p = softmax(z)
    assert mx.allclose(p, mx.softmax(z, axis=-1), rtol=1e-4, atol=1e-8).item()
    assert mx.allclose(p.sum(axis=-1), mx.ones((4, 5)), atol=1e-5).item()


def _textbook_loss(drafter, hidden, emb, targets, valid, teacher, soft):
    """The loss written out: per step, −Σ p log_softmax(z) on soft rows, CE(z, target) on the
    others, averaged over valid rows and summed over steps."""
    B, T, H = emb.shape
    state, part, total = mx.zeros((B, H)), drafter.hidden_part(hidden), 0.0
    for k in range(T):
        state = drafter.next_state(state, emb[:, k])
        logits = drafter.head(part, state)
        hard = nn.losses.cross_entropy(logits, targets[:, k])
        full = -(teacher[:, k] * nn.log_softmax(logits, axis=-1)).sum(axis=-1)
        ce = mx.where(soft[:, k], full, hard)
        v = valid[:, k].astype(mx.float32)
        total = total + (ce * v).sum() / mx.maximum(v.sum(), 1.0)
    return total


def test_drafter_loss_and_gradient_equal_the_textbook_form():
    H, V, B, T = 16, 40, 9, 3
    drafter = Drafter(DrafterArgs(vocab_size=V, hidden_size=H, exit_dim=H))
    drafter.set_dtype(mx.float32)
    keys = mx.random.split(mx.random.key(3), 6)
    hidden = mx.random.normal((B, H), key=keys[0])
    emb = mx.random.normal((B, T, H), key=keys[1])
    targets = mx.random.randint(0, V, (B, T), key=keys[2])
    teacher = mx.softmax(3 * mx.random.normal((B, T, V), key=keys[3]), axis=-1)
    soft = mx.random.bernoulli(0.6, (B, T), key=keys[4])
    valid = mx.random.bernoulli(0.8, (B, T), key=keys[5])
    args = (hidden, emb, targets, valid, teacher, soft)
    ours, grads = nn.value_and_grad(drafter, lambda *a: drafter_loss(*a)[0])(drafter, *args)
    want, want_grads = nn.value_and_grad(drafter, _textbook_loss)(drafter, *args)
    assert abs(ours.item() - want.item()) < 1e-4 * abs(want.item())
    for (name, g), (_, w) in zip(tree_flatten(grads), tree_flatten(want_grads)):
        assert mx.allclose(g, w, rtol=1e-3, atol=1e-6).item(), name
    # the check can fail: a teacher that is not the one given changes the loss
    other = drafter_loss(drafter, hidden, emb, targets, valid, mx.softmax(teacher * 5), soft)[0]
    assert abs(other.item() - want.item()) > 1e-3
