"""An independent float64 implementation of ELO as ``docs/elo.md`` defines it.

ELO's state, accumulators (with its own decays), features, normalisation, time features and MLP are
small_fc_lopt's (docs/elo.md §1–§3.8 refer to docs/small_fc_lopt.md), so this oracle takes them from
the float64 oracle of small_fc_lopt, ``spec_small_fc_lopt``, and adds what ELO defines differently:
the decays (§2), the global gradient clipping (§3.1) and the update (§3.9). Like that oracle, it
imports nothing from lopt.
"""

from __future__ import annotations

import struct

import torch

import spec_small_fc_lopt as sfc

F64 = torch.float64


def _float32(x: float) -> float:
    """``x`` rounded to float32, as a Python float (the decays are float32 tensors in ELO, §2)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


# §2: the decays as given (PyLO's ELO_naive defaults), rounded to float32; no reparameterisation.
BETA_M = tuple(_float32(x) for x in (0.9, 0.99, 0.999))
BETA_V = _float32(0.999)
BETA_F = tuple(_float32(x) for x in (0.9, 0.99, 0.999))
DECAYS = (BETA_M, (BETA_V,), BETA_F)

# §3.9 defaults
LR = 1e-3
EXP_MULT = 0.001

new_state = sfc.new_state
from_pylo_state = sfc.from_pylo_state
to_pylo_state = sfc.to_pylo_state


def decays_of(momentum, rms, adafactor) -> tuple:
    """§2 for other values given: each rounded to float32 and used as it is."""
    return (tuple(_float32(x) for x in momentum), tuple(_float32(x) for x in rms), tuple(_float32(x) for x in adafactor))


def global_clip_factor(grads, max_norm: float) -> float:
    """§3.1: min(1, max_norm / ‖g‖₂), the norm over every gradient given (all of the optimizer's)."""
    norm = sum(float((g.to(F64) ** 2).sum()) for g in grads) ** 0.5
    return 1.0 if norm <= max_norm else max_norm / norm


def step(p, g, state: dict, t: int, net: dict, *, lr=LR, weight_decay=0.0, exp_mult=EXP_MULT, decays=DECAYS) -> dict:
    """One step for one tensor (float64), ``g`` already clipped (§3.1). Updates ``state`` in place; returns
    the new parameter ``p``, the update ``u`` (before lr and weight decay) and the MLP outputs."""
    p = p.to(F64)
    g = g.to(F64)
    sfc.accumulate(state, g, decays)
    normed = sfc.normalise(sfc.features(g, p, state))
    shape = tuple(p.shape)
    x = torch.cat([normed, sfc.time_features(t).expand(shape + (11,))], dim=-1)
    direction, magnitude = sfc.mlp(x, net)
    u = direction * torch.exp(exp_mult * magnitude)  # §3.9: no step_mult
    new_p = p - lr * (u + weight_decay * p)  # the decay of the pre-update p, inside the step
    return {"p": new_p, "u": u, "direction": direction, "magnitude": magnitude}
