"""Softmax pieces for the distillation loss, cheap on MLX's CPU backend.

The loss and the soft targets run over every head id of every position: 1,280 rows of 8,192
ids per training step at the shipped shape. There MLX's CPU ``exp`` costs ~14 ns per element
(scalar, unfused: 146 ms for those 10.5M values on a 2-core x86 VM) while a fused compiled
polynomial costs ~55 ms, so the exponentials, not the matmuls, set the step time. On a GPU the
backend's own ``exp`` is used.

``exp`` here: e^x = (e^(x / 256))^256, e^t (t in [-0.34, 0]) by its degree-7 Taylor
polynomial, then eight squarings; relative error < 5e-5 for x in [-87, 0] (what a softmax feeds
it, the row maximum subtracted); x below -87 counts as -87 (e^-87 ~ 1.6e-38, nothing a softmax
sum notices). Training only: decoding never calls it.

Shapes: (..., V) rows of logits.
"""

from __future__ import annotations

import mlx.core as mx

FLUSH = 2.0**-100  # probabilities below it are 0 (``_probabilities``: no subnormal gradients)
_SQUARINGS = 8
_TAYLOR = [1.0]
for _i in range(1, 8):
    _TAYLOR.append(_TAYLOR[-1] / _i)


def _poly_exp(x: mx.array) -> mx.array:
    """e^x for x <= 0 (elementwise; fused into one kernel by ``mx.compile``)."""
    t = mx.maximum(x, -87.0) * (1.0 / 2**_SQUARINGS)
    p = _TAYLOR[-1]
    for c in reversed(_TAYLOR[:-1]):
        p = p * t + c
    for _ in range(_SQUARINGS):
        p = p * p
    return p


_compiled_exp = mx.compile(_poly_exp)


def exp_nonpositive(x: mx.array) -> mx.array:
    """e^x for x <= 0 (a softmax's shifted logits): the fused polynomial on the CPU, the
    backend's ``exp`` on a GPU."""
    if mx.default_device().type == mx.DeviceType.gpu:
        return mx.exp(x)
    return _compiled_exp(x)


def logsumexp(z: mx.array) -> mx.array:
    """log Σ_v e^z over the last axis: (..., V) -> (...,); its gradient is softmax(z).

    The softmax is made in the forward pass (one fused exp) and the gradient reaches ``z``
    through a term whose value is zero, ``Σ p (z - stop_gradient(z))``: MLX does not run
    compiled kernels inside a custom vjp (``mx.custom_function``: 544 ms against 63 ms for the
    same backward at the shipped shape), and differentiating the polynomial itself would
    cost more still.
    """
    zs = mx.stop_gradient(z)
    m, e, s = _shifted_exp(zs)
    return (m + mx.log(s))[..., 0] + mx.sum(_probabilities(e, s) * (z - zs), axis=-1)


def softmax(z: mx.array) -> mx.array:
    """Probabilities over the last axis: (..., V) -> (..., V) float32 (no gradient needed);
    those below ``FLUSH`` are exactly 0 (``_probabilities``)."""
    _, e, s = _shifted_exp(z)
    return _probabilities(e, s)


def _probabilities(e: mx.array, s: mx.array) -> mx.array:
    """e / s (..., V), every value below ``FLUSH`` set to exactly 0.

    A confident drafter puts nearly every id more than 87 below the row maximum, where e is
    the clamp's e^-87 ~ 1.6e-38; the loss's gradient at the logits is that probability times
    1/n (n valid positions), below float32's smallest normal number (1.2e-38): on the rigged
    always-the-same-token model 20.37M of the 20.48M logit gradients of a step were
    subnormal, and they feed the head's backward matmuls and AdamW, which on many x86 CPUs
    take a microcode assist per subnormal operand. Flushed at 2^-100, a probability times
    1/n stays normal for any n up to 2^26; what the flush drops from a softmax (V x 8e-31)
    nothing in float32 notices.
    """
    p = e / s
    return mx.where(p < FLUSH, 0.0, p)


def _shifted_exp(z: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The row maximum m (..., 1), e = e^(z - m) (..., V) and its row sum (..., 1)."""
    m = mx.max(z, axis=-1, keepdims=True)
    e = exp_nonpositive(z - m)
    return m, e, mx.sum(e, axis=-1, keepdims=True)
