"""An independent float64 implementation of small_fc_lopt as ``docs/small_fc_lopt.md`` defines it.

Section numbers below refer to that page, lopt's decisions (its §5.1) included: the stable tie
rule for the factored axes (D1), a 0-d parameter normalised per feature (D2). Nothing here
imports ``lopt.reference``: the tests use it as the oracle for lopt's float32 reference, the
optimizer front-end and (later) the fused kernels.

Layout. The oracle keeps its accumulators the way the definition writes them, one tensor per
decay: ``m[k]``, ``v``, ``R[k]``, ``C[k]``, ``V[k]`` (float64, shapes as in §1.1 without the trailing
decay axis). :func:`to_pylo_state` / :func:`from_pylo_state` convert to and from PyLO's layout
(decay axis last), which lopt's optimizer state uses.
"""

from __future__ import annotations

import struct

import torch

F64 = torch.float64


def _f32(bits: int) -> float:
    """The float32 value with the given IEEE-754 bit pattern, as a Python float (exact)."""
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# §2: the effective float32 decays of the PyLO constructor defaults (bit patterns from the table of §2).
MOMENTUM_DECAY_BITS = (0x3F0AC24D, 0x3F755C6A, 0x3F7F7E79)
RMS_DECAY_BITS = (0x3F7FB6FE,)
ADAFACTOR_DECAY_BITS = (0x3EB6623A, 0x3F7F22E0, 0x3F7FDCB2)
BETA_M = tuple(_f32(b) for b in MOMENTUM_DECAY_BITS)
BETA_V = _f32(RMS_DECAY_BITS[0])
BETA_F = tuple(_f32(b) for b in ADAFACTOR_DECAY_BITS)

# §3.7
TIME_SCALES = (1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0, 30000.0, 100000.0)

# PyLO defaults (§3.9)
EXP_MULT = 0.001
STEP_MULT = 0.01


def float32_decay_chain(initial, offset) -> float:
    """§2 evaluated in float32 with torch ops in the order §2 prescribes: 1 − exp(10·(ln(1 − β0)/10 + θ)), clipped."""
    b = torch.tensor(initial, dtype=torch.float32)
    o = torch.tensor(offset, dtype=torch.float32)
    y = torch.log(1 - b) / 10
    y = y + o
    beta = 1 - torch.exp(y * 10)
    return float(torch.clip(beta, 0, 1))


# ------------------------------------------------------------------------------------------
# §3.3 factored dims
# ------------------------------------------------------------------------------------------


def factored_axes(shape):
    """(d1, d0) or None. d0 = a largest axis (the highest index among equal sizes: a stable ascending
    sort puts it last); d1 = a largest of the remaining axes, again the highest index among ties."""
    shape = tuple(shape)
    if len(shape) < 2:
        return None
    d0 = 0
    for axis, size in enumerate(shape):
        if size >= shape[d0]:
            d0 = axis
    d1 = None
    for axis, size in enumerate(shape):
        if axis == d0:
            continue
        if d1 is None or size >= shape[d1]:
            d1 = axis
    return d1, d0


# ------------------------------------------------------------------------------------------
# §1.1 state, §3.2 accumulators
# ------------------------------------------------------------------------------------------


def new_state(shape) -> dict:
    shape = tuple(shape)
    dims = factored_axes(shape)
    z = lambda s: torch.zeros(s, dtype=F64)  # noqa: E731
    state = {"m": [z(shape) for _ in range(3)], "v": z(shape), "R": None, "C": None, "V": None}
    if dims is None:
        state["V"] = [z(shape) for _ in range(3)]
    else:
        d1, d0 = dims
        state["R"] = [z(shape[:d0] + shape[d0 + 1:]) for _ in range(3)]
        state["C"] = [z(shape[:d1] + shape[d1 + 1:]) for _ in range(3)]
    return state


def accumulate(state: dict, g: torch.Tensor, decays=None) -> None:
    """§3.2 in place (float64). ``decays``: ``(β_m, β_v, β_f)`` (3, 1 and 3 values) instead of §2's
    (ELO's are its raw decays: spec_elo.py)."""
    beta_m, (beta_v,), beta_f = decays if decays is not None else (BETA_M, (BETA_V,), BETA_F)
    g = g.to(F64)
    dims = factored_axes(g.shape)
    for k in range(3):
        state["m"][k] = beta_m[k] * state["m"][k] + (1 - beta_m[k]) * g
    state["v"] = beta_v * state["v"] + (1 - beta_v) * (g * g)
    big_g = g * g + 1e-30
    for k in range(3):
        if dims is None:
            state["V"][k] = beta_f[k] * state["V"][k] + (1 - beta_f[k]) * big_g
        else:
            d1, d0 = dims
            state["R"][k] = beta_f[k] * state["R"][k] + (1 - beta_f[k]) * big_g.mean(dim=d0)
            state["C"][k] = beta_f[k] * state["C"][k] + (1 - beta_f[k]) * big_g.mean(dim=d1)


def _safe_rsqrt(x):
    return 1.0 / torch.sqrt(torch.clamp(x, min=1e-9))


def row_col_factors(state: dict, shape):
    """§3.4: (rf_k, cf_k) for k = 0..2, each broadcastable to ``shape`` (factored tensors only)."""
    d1, d0 = factored_axes(shape)
    rf, cf = [], []
    for k in range(3):
        row_full = state["R"][k].unsqueeze(d0)  # back to rank r, size 1 on axis d0
        col_full = state["C"][k].unsqueeze(d1)
        row_col_mean = row_full.mean(dim=d1, keepdim=True)  # the mean over the axis that was d1
        rf.append(_safe_rsqrt(row_full / (row_col_mean + 1e-9)))
        cf.append(_safe_rsqrt(col_full))
    return rf, cf


# ------------------------------------------------------------------------------------------
# §3.5 features
# ------------------------------------------------------------------------------------------


def features(g: torch.Tensor, p: torch.Tensor, state: dict) -> torch.Tensor:
    """The 28 per-element features (``S + (28,)``, float64) from the updated state and the pre-update p."""
    g = g.to(F64)
    p = p.to(F64)
    shape = tuple(g.shape)
    dims = factored_axes(shape)
    m, v = state["m"], state["v"]
    rho = 1.0 / torch.sqrt(v + 1e-6)
    cols = [g, p, m[0], m[1], m[2], v, m[0] * rho, m[1] * rho, m[2] * rho, rho]
    if dims is None:
        full = state["V"]
        cols += [g * _safe_rsqrt(full[k] + 1e-9) for k in range(3)]  # 10-12
        cols += [full[k] for k in range(3)]  # 13-15
        cols += [full[k] for k in range(3)]  # 16-18
        cols += [1.0 / torch.sqrt(full[k] + 1e-8) for k in range(3)]  # 19-21
        cols += [1.0 / torch.sqrt(full[k] + 1e-8) for k in range(3)]  # 22-24
        cols += [m[k] * (full[k] + 1e-6) ** -0.5 for k in range(3)]  # 25-27
    else:
        d1, d0 = dims
        rf, cf = row_col_factors(state, shape)
        row = [state["R"][k].unsqueeze(d0).expand(shape) for k in range(3)]
        col = [state["C"][k].unsqueeze(d1).expand(shape) for k in range(3)]
        cols += [g * rf[k] * cf[k] for k in range(3)]  # 10-12
        cols += row  # 13-15
        cols += col  # 16-18
        cols += [1.0 / torch.sqrt(row[k] + 1e-8) for k in range(3)]  # 19-21
        cols += [1.0 / torch.sqrt(col[k] + 1e-8) for k in range(3)]  # 22-24
        cols += [m[k] * rf[k] * cf[k] for k in range(3)]  # 25-27
    assert len(cols) == 28
    return torch.stack([c.expand(shape) for c in cols], dim=-1)


# ------------------------------------------------------------------------------------------
# §3.6 normalisation, §3.7 time features, §3.8 MLP, §3.9 update
# ------------------------------------------------------------------------------------------


def normalise(feats: torch.Tensor, *, naive_rank0: bool = False) -> torch.Tensor:
    """x_j · (1e-5 + mean over the tensor's elements of x_j²)^(−1/2), per feature column j.

    A 0-d parameter's features have shape (28,): its one element is its own mean (§3.6, decision D2).
    ``naive_rank0=True`` gives PyLO naive's artifact instead (one value shared by all 28 features),
    used only to show that the tests can tell the two apart.
    """
    if naive_rank0 and feats.dim() == 1:
        return feats / torch.sqrt(1e-5 + (feats * feats).mean())
    flat = feats.reshape(-1, feats.shape[-1])
    second_moment = (flat * flat).mean(dim=0)
    return feats / torch.sqrt(1e-5 + second_moment)


def time_features(t: int) -> torch.Tensor:
    tau = float(t - 1)
    return torch.tanh(torch.tensor([tau / T - 1.0 for T in TIME_SCALES], dtype=F64))


def mlp(x: torch.Tensor, net: dict):
    """39 → h → (h → h) × hidden_layers → 2 with ReLU (the published weights: h = 32, one linear_0), PyTorch
    (out × in) weights; returns (direction, magnitude)."""
    w = {k: t.to(F64) for k, t in net.items()}
    h = torch.clamp(x @ w["network.input.weight"].T + w["network.input.bias"], min=0)
    i = 0
    while f"network.linear_{i}.weight" in w:
        h = torch.clamp(h @ w[f"network.linear_{i}.weight"].T + w[f"network.linear_{i}.bias"], min=0)
        i += 1
    out = h @ w["network.output.weight"].T + w["network.output.bias"]
    return out[..., 0], out[..., 1]


def step(p, g, state: dict, t: int, net: dict, *, lr=1.0, weight_decay=0.0, exp_mult=EXP_MULT,
         step_mult=STEP_MULT, naive_rank0=False) -> dict:
    """One step for one tensor (float64). Updates ``state`` in place; returns a dict with the new
    parameter ``p``, the update ``u`` (before lr), the raw and normalised features and the MLP inputs."""
    p = p.to(F64)
    g = g.to(F64)
    accumulate(state, g)
    raw = features(g, p, state)
    normed = normalise(raw, naive_rank0=naive_rank0)
    shape = tuple(p.shape)
    x = torch.cat([normed, time_features(t).expand(shape + (11,))], dim=-1)
    direction, magnitude = mlp(x, net)
    u = direction * torch.exp(exp_mult * magnitude) * step_mult
    new_p = p - lr * u
    if weight_decay > 0:
        new_p = new_p - (weight_decay * lr) * new_p
    return {"p": new_p, "u": u, "features": raw, "normalised": normed, "inputs": x,
            "direction": direction, "magnitude": magnitude}


# ------------------------------------------------------------------------------------------
# Conversions to / from PyLO's layout (decay axis last)
# ------------------------------------------------------------------------------------------


def to_pylo_state(state: dict, shape) -> dict:
    dims = factored_axes(shape)
    empty = torch.zeros(0, dtype=F64)
    out = {"mom": torch.stack(state["m"], dim=-1), "rms": state["v"].unsqueeze(-1)}
    if dims is None:
        out.update(fac_vec_row=empty, fac_vec_col=empty, fac_vec_v=torch.stack(state["V"], dim=-1))
    else:
        out.update(fac_vec_row=torch.stack(state["R"], dim=-1), fac_vec_col=torch.stack(state["C"], dim=-1),
                   fac_vec_v=empty)
    return out


def from_pylo_state(buffers: dict, shape) -> dict:
    """The oracle's float64 state from PyLO-layout buffers (e.g. a float32 optimizer state)."""
    shape = tuple(shape)
    dims = factored_axes(shape)
    get = lambda name: buffers[name].detach().to("cpu", F64)  # noqa: E731
    mom = get("mom").reshape(shape + (3,))
    state = {"m": [mom[..., k].clone() for k in range(3)], "v": get("rms").reshape(shape + (1,))[..., 0].clone(),
             "R": None, "C": None, "V": None}
    if dims is None:
        full = get("fac_vec_v").reshape(shape + (3,))
        state["V"] = [full[..., k].clone() for k in range(3)]
    else:
        state["R"] = [get("fac_vec_row")[..., k].clone() for k in range(3)]
        state["C"] = [get("fac_vec_col")[..., k].clone() for k in range(3)]
    return state


def clone_state(state: dict) -> dict:
    return {k: (None if v is None else ([x.clone() for x in v] if isinstance(v, list) else v.clone()))
            for k, v in state.items()}
