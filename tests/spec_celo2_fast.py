"""The fused CELO2's ``precision="fast"`` arithmetic as docs/celo2.md §8.1 states it, in torch: which values
are rounded to bfloat16, and where float32 sums them.

* The MLP (``celo2_mlp`` on tensor cores): an element's own 18 normalised inputs and the first layer's
  weights for them in bfloat16; the table features' share plus ``b0`` (its *start*, float32) rounded to
  bfloat16 once; products summed in float32. Each later layer: its input ``relu(h)`` and its weights in
  bfloat16, its bias in float32.
* Newton–Schulz: the step divided by its norm, rounded to bfloat16, then the engine's own bfloat16 products
  (``lopt.fused.celo2.newton_schulz_products``, whose fast form tests/test_fused_celo2.py holds to the
  reference's iteration).

:func:`fast_arithmetic` runs lopt's float32 reference (the naive backend) with these two in place of its
``mlp`` and ``newton_schulz``: the transcription the fused fast mode is held to on the GPU
(tests/test_fused.py), since where Newton–Schulz amplifies rounding the fast mode's distance from the exact
step is the arithmetic's own, not the kernel's.
"""

from __future__ import annotations

import contextlib

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


def fast_newton_schulz(x: torch.Tensor, coefficients=reference.NS_COEFFICIENTS, steps: int = reference.NS_STEPS,
                       eps: float = reference.NS_EPSILON) -> torch.Tensor:
    """``reference.newton_schulz`` on bfloat16 matrices, as the fused fast mode runs it."""
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    shape = x.shape
    x = x.reshape(-1, *shape[-2:])
    norm = torch.sqrt(accumulators.float64_square_sum(x, dim=(-2, -1), keepdim=True)).to(torch.float32)
    first = (x / (norm + eps)).to(torch.bfloat16).contiguous()
    k = shape[-2]
    gram = torch.empty(first.shape[0], k, k, dtype=torch.bfloat16, device=x.device)
    result = newton_schulz_products(first, torch.empty_like(first), gram, torch.empty_like(gram), coefficients,
                                    steps, exact=False)
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
