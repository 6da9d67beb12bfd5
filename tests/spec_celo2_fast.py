"""The fused CELO2's ``precision="fast"`` arithmetic as docs/celo2.md §8.1 states it, in torch: which values
are rounded to bfloat16, and where float32 sums them.

* The MLP (``celo2_mlp`` on tensor cores): an element's own 18 normalised inputs and the first layer's
  weights for them in bfloat16; the table features' share plus ``b0`` (its *start*, float32) rounded to
  bfloat16 once; products summed in float32. Each later layer: its input ``relu(h)`` and its weights in
  bfloat16, its bias in float32.
* Newton–Schulz: the step itself rounded to bfloat16 (a finite value beyond bfloat16's range saturated), and the
  engine's own bfloat16 products (``lopt.fused.celo2.newton_schulz_products``, whose fast form
  tests/test_fused_celo2.py holds to the reference's iteration), whose first polynomial divides by the norm
  ``d``: coefficients ``(a/d, b/d³, c/d⁵)`` in float64 rounded to float32 (``first``). Where ``d`` lies outside
  [2^-24, 2^24], the bfloat16 step divided by ``d`` and rounded again, and the coefficients themselves. A matrix
  of one row or column, and zero steps: the step divided by its norm, rounded to bfloat16.

:func:`fast_arithmetic` runs lopt's float32 reference (the naive backend) with these two in place of its
``mlp`` and ``newton_schulz``: the transcription the fused fast mode is held to on the GPU
(tests/test_fused.py), since where Newton–Schulz amplifies rounding the fast mode's distance from the exact
step is the arithmetic's own, not the kernel's.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from lopt.fused.celo2 import TABLE_INPUTS, newton_schulz_products
from lopt.reference import accumulators
from lopt.reference import celo2 as reference


def bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16 (to nearest even), held as float32."""
    return x.to(torch.bfloat16).to(torch.float32)


def fast_mlp(inputs: torch.Tensor, network: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.mlp`` as the tensor cores compute it (``inputs``: ``... × 30`` or ``... × 15``)."""
    count = inputs.shape[-1]
    w0 = reference.first_layer_weight(network, count)
    table = [i for i in TABLE_INPUTS if i < count]
    own = [i for i in range(count) if i not in table]
    start = network[reference.FIRST_BIAS] + (inputs[..., table] @ w0[table] if table else 0.0)
    hidden = bf16(inputs[..., own]) @ bf16(w0[own]) + bf16(start)
    for j in range(reference.dense_layer_count(network)):
        weight, bias = network[reference.DENSE_WEIGHT.format(j)], network[reference.DENSE_BIAS.format(j)]
        hidden = bf16(torch.relu(hidden)) @ bf16(weight) + bias
    return hidden[..., 0], hidden[..., 1]


BF16_MAX = 3.38953139e38  # bfloat16's largest finite value
DIRECT_RANGE = (2.0 ** -24, 2.0 ** 24)  # the divisors the first polynomial takes (celo2.cu, C2_DIRECT_MIN/MAX)


def fast_newton_schulz(x: torch.Tensor, coefficients=reference.NS_COEFFICIENTS, steps: int = reference.NS_STEPS,
                       eps: float = reference.NS_EPSILON) -> torch.Tensor:
    """``reference.newton_schulz`` on bfloat16 matrices, as the fused fast mode runs it."""
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    shape = x.shape
    x = x.reshape(-1, *shape[-2:])
    norm = torch.sqrt(accumulators.float64_square_sum(x, dim=(-2, -1), keepdim=True)).to(torch.float32)
    divisor = norm + eps
    k = shape[-2]
    if k == 1 or steps == 0:  # (celo2_normalise divides these: a scalar recurrence, or no products)
        matrices, first = (x / divisor).to(torch.bfloat16).contiguous(), None
    else:
        a, b, c = (float(np.float32(value)) for value in coefficients)  # (as the kernel holds them)
        direct = (divisor >= DIRECT_RANGE[0]) & (divisor <= DIRECT_RANGE[1])
        step = x.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)
        matrices = torch.where(direct, step, (step.float() / divisor).to(torch.bfloat16)).contiguous()
        d = torch.where(direct, divisor.double(), 1.0).reshape(-1)
        cube = d * d * d
        first = torch.stack([a / d, b / cube, c / (cube * d * d), torch.zeros_like(d)], dim=1).to(torch.float32)
    gram = torch.empty(matrices.shape[0], k, k, dtype=torch.bfloat16, device=x.device)
    result = newton_schulz_products(matrices, torch.empty_like(matrices), gram, torch.empty_like(gram), coefficients,
                                    steps, exact=False, first=first)
    result = result.to(torch.float32).reshape(shape)
    return result.mT if transposed else result


@contextlib.contextmanager
def fast_arithmetic():
    """lopt's reference with the fast mode's MLP and Newton–Schulz (restored after)."""
    saved = reference.mlp, reference.newton_schulz
    reference.mlp, reference.newton_schulz = fast_mlp, fast_newton_schulz
    try:
        yield
    finally:
        reference.mlp, reference.newton_schulz = saved
