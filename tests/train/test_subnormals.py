"""A confident drafter trains as fast as an unsure one: no subnormal float32 numbers in the
loss's gradient, the soft targets or AdamW's moments once the drafter is saturated (subnormal
operands cost many x86 CPUs a microcode assist each; measured on the rigged always-the-same-
token model: 20.37M of 20.48M logit gradients and 9.5M of the head's 16.4M second moments
were subnormal before). The check counts subnormals, not seconds."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from redrafter_mlx.train.options import DistillOptions
from redrafter_mlx.train.softmax import logsumexp, softmax
from redrafter_mlx.train.training import Trainer
from tests.support.models import tiny_drafter, tiny_model

SMALLEST_NORMAL = 1.1754944e-38


def subnormals(x: mx.array) -> int:
    return int(((x != 0) & (mx.abs(x) < SMALLEST_NORMAL)).sum().item())


def saturated_logits(B=128, V=2048, margin=300.0):
    """(B, V) logits whose target (id 0) is ``margin`` above every other id."""
    z = mx.random.normal((B, V), key=mx.random.key(0))
    return z + margin * (mx.arange(V) == 0), mx.zeros((B,), dtype=mx.int32)


def test_the_loss_gradient_and_soft_targets_of_a_saturated_head_have_no_subnormals():
    z, targets = saturated_logits()
    B = z.shape[0]

    def hard(z):  # the cross-entropy as drafter_loss writes it, averaged over B rows
        return ((logsumexp(z) - z[mx.arange(B), targets]) / B).sum()

    grad = mx.grad(hard)(z)
    assert subnormals(grad) == 0
    assert mx.allclose(
        grad,
        mx.grad(lambda z: mx.logsumexp(z, axis=-1).sum() / B)(z) - (mx.arange(z.shape[1]) == 0) / B,
        atol=1e-12,
    ).item()  # still the gradient (what was dropped is < 1e-30)
    teacher = softmax(z)
    assert subnormals(teacher) == 0 and mx.allclose(teacher.sum(-1), mx.ones(B)).item()
    soft_grad = mx.grad(lambda z: ((logsumexp(z) - (teacher * z).sum(-1)) / B).sum())(z)
    assert subnormals(soft_grad) == 0


def test_adamw_moments_of_a_saturated_drafter_have_no_subnormals():
    """A drafter whose head is scaled up 1000x is sure of its argmax; trained on those argmaxes
    its gradients for every other id are tiny, and g^2 would underflow."""
    model = tiny_model(vocab=1024, hidden=16)
    drafter = tiny_drafter(model, layers=1)
    head = drafter.lm_head[-1]
    head.weight = head.weight * 1000
    B, T, H = 64, 2, model.hidden_size
    hidden = mx.random.normal((B, H), key=mx.random.key(1))
    emb = mx.random.normal((B, T, H), key=mx.random.key(2))
    state, part, targets = mx.zeros((B, H)), drafter.hidden_part(hidden), []
    for k in range(T):
        state = drafter.next_state(state, emb[:, k])
        targets.append(mx.argmax(drafter.head(part, state), axis=-1))
    batch = (hidden, emb, mx.stack(targets, 1).astype(mx.int32), mx.ones((B, T), dtype=mx.bool_))
    trainer = Trainer(drafter, DistillOptions(lr=1e-6, warmup=0), total_steps=10)
    for _ in range(3):
        loss, _, _ = trainer.step([batch])
    assert loss.item() < 1e-3  # saturated: the drafter is sure and right
    moments = [v for name, v in tree_flatten(trainer.optimizer.state) if name[-2:] in (".m", ".v")]
    assert moments and sum(subnormals(v) for v in moments) == 0
    assert sum(subnormals(p) for _, p in tree_flatten(drafter.parameters())) == 0
