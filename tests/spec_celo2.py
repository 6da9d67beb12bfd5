"""An independent float64 implementation of CELO2 and ELO-CELO2 as ``docs/celo2.md`` defines them.

Section numbers refer to that page, lopt's decisions (§7) included. Nothing here imports lopt: the
tests use it as the oracle for lopt's float32 reference and the optimizer front-ends (and, later, a
fused backend).

Layout. The oracle keeps one tensor per decay, as the definition writes them: ``m[k]``, ``v``, ``R[k]``,
``C[k]``, ``V[k]`` (float64, the parameter's shape without the trailing decay axis), and for CELO2's AdamW
branch ``mu``, ``nu`` and the count ``t``. :func:`from_lopt_state` / :func:`to_lopt_state` convert from and
to lopt's state layout (PyLO's names, decay axis last).
"""

from __future__ import annotations

import struct

import torch

import spec_small_fc_lopt as small_fc

F64 = torch.float64


def f32(x: float) -> float:
    """The float32 value nearest to ``x``, as a Python float (exact)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


# §2: the decays are the given numbers rounded to float32 (no offset parametrisation).
BETA_M = tuple(f32(b) for b in (0.9, 0.99, 0.999))
BETA_V = f32(0.95)
BETA_F = tuple(f32(b) for b in (0.9, 0.99, 0.999))

# §3.6 Newton–Schulz: the coefficients rounded to float32, as both sources multiply in float32.
NS = tuple(f32(c) for c in (3.4445, -4.7750, 2.0315))

# §6: the split first layer's group widths, in input order (9 groups for rank <= 1).
WIDTHS = (1, 1, 1, 3, 1, 3, 1, 3, 1, 3, 3, 3, 3, 3)


# ------------------------------------------------------------------------------------------ §3.2 factored axes


# The state, its shapes and the accumulators (§1, §3.2) are small_fc_lopt's with CELO2's decays.
factored_axes = small_fc.factored_axes


def work_shape(shape):
    """A 0-d parameter is a 1-element vector (§7 D2)."""
    return tuple(shape) if len(shape) else (1,)


# ------------------------------------------------------------------------------------------ §3.1 gradient


def clip_all(grads, max_norm, clip_value=1000.0):
    """§3.1: every gradient scaled by max_norm / max(‖g‖, max_norm) (‖g‖ over all of them; max_norm None: no
    scaling), then clamped to ±clip_value."""
    grads = [g.to(F64) for g in grads]
    if max_norm is not None:
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        scale = max_norm / max(float(norm), max_norm)
        grads = [g * scale for g in grads]
    return [torch.clamp(g, -clip_value, clip_value) for g in grads]


# ------------------------------------------------------------------------------------------ §1, §3.2 state


def new_state(shape) -> dict:
    return small_fc.new_state(work_shape(shape))


def accumulate(state: dict, g: torch.Tensor) -> None:
    small_fc.accumulate(state, g.to(F64).reshape(state["v"].shape), decays=(BETA_M, (BETA_V,), BETA_F))


# ------------------------------------------------------------------------------------------ §3.3 features


def _floor_rsqrt(x):
    return torch.clamp(x, min=1e-9) ** -0.5


def features(g, p, state) -> list:
    """The feature groups in input order, each ``S + (width,)`` (float64)."""
    shape = state["v"].shape
    g = g.to(F64).reshape(shape)
    p = p.to(F64).reshape(shape)
    dims = factored_axes(shape)
    m = torch.stack(state["m"], dim=-1)
    v = state["v"].unsqueeze(-1)
    rho = (v + 1e-8) ** -0.5
    if dims is None:
        fac_g = torch.stack([g * _floor_rsqrt(state["V"][k] + 1e-9) for k in range(3)], dim=-1)
    else:
        d1, d0 = dims
        rf, cf = [], []
        for k in range(3):
            row = state["R"][k].unsqueeze(d0)
            rf.append(_floor_rsqrt(row / (row.mean(dim=d1, keepdim=True) + 1e-9)))
            cf.append(_floor_rsqrt(state["C"][k].unsqueeze(d1)))
        fac_g = torch.stack([g * rf[k] * cf[k] for k in range(3)], dim=-1)
    gc = g.unsqueeze(-1)
    groups = [gc, gc.clamp(-0.1, 0.1), p.unsqueeze(-1), m, v, m * rho, rho, fac_g, gc * rho]
    if dims is not None:
        row = torch.stack([state["R"][k].unsqueeze(d0).expand(shape) for k in range(3)], dim=-1)
        col = torch.stack([state["C"][k].unsqueeze(d1).expand(shape) for k in range(3)], dim=-1)
        fac_m = torch.stack([m[..., k] * rf[k] * cf[k] for k in range(3)], dim=-1)
        groups += [row, col, (row + 1e-8) ** -0.5, (col + 1e-8) ** -0.5, fac_m]
    return [x.expand(shape + x.shape[-1:]) for x in groups]


# ------------------------------------------------------------------------------------------ §3.4 normalisation


def normalise(x, rank, eps=1e-9):
    """x · (eps + mean of x² over the parameter's last two axes)^(-1/2), per column of the last axis."""
    axes = list(range(rank))[-2:]
    return x / torch.sqrt(eps + (x * x).mean(dim=axes, keepdim=True))


# ------------------------------------------------------------------------------------------ §3.5 MLP


def mlp(groups, net):
    """Σ_i x_i @ w0.i + b0 (one weight per group, ``x @ w``), ReLU, then the dense layers (ReLU between)."""
    w = {k: t.to(F64) for k, t in net.items()}
    h = w["b0"]
    for i, x in enumerate(groups):
        h = h + x @ w[f"w0.{i}"]
    h = torch.relu(h)
    j = 0
    while f"dense_w.{j}" in w:
        h = h @ w[f"dense_w.{j}"] + w[f"dense_b.{j}"]
        if f"dense_w.{j + 1}" in w:
            h = torch.relu(h)
        j += 1
    return h[..., 0], h[..., 1]


# ------------------------------------------------------------------------------------------ §3.6 Newton–Schulz


def newton_schulz(x, steps=5, eps=1e-8, coefficients=NS):
    """Per matrix of the last two axes: transpose if rows > cols, divide by ‖X‖_F + eps, iterate
    X ← aX + (bA + cA²)X with A = XXᵀ."""
    x = x.to(F64)
    flip = x.shape[-2] > x.shape[-1]
    if flip:
        x = x.transpose(-2, -1)
    x = x / (torch.sqrt((x * x).sum(dim=(-2, -1), keepdim=True)) + eps)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.transpose(-2, -1) if flip else x


# ------------------------------------------------------------------------------------------ §3.3–§3.8 one step


def learned_step(p, g, state, net, *, lr, weight_decay, exp_mult=0.0, rms_mult=1.0, param_scale_mult=False,
                 orthogonalize=True, ns_steps=5, ns_eps=1e-8) -> dict:
    """The learned branch for one tensor (``g`` after §3.1). Updates ``state``; returns the new ``p`` (the
    parameter's own shape) and the intermediate values."""
    shape = tuple(p.shape)
    accumulate(state, g)
    groups = features(g, p, state)
    rank = len(work_shape(shape))
    normed = [normalise(x, rank) for x in groups]
    direction, magnitude = mlp(normed, net)
    scale = torch.exp(magnitude * exp_mult)
    value = p.to(F64).reshape(work_shape(shape))
    if param_scale_mult:
        scale = torch.sqrt((value * value).mean() + 1e-9) * scale
    u = direction * scale
    if orthogonalize and rank >= 2:
        u = newton_schulz(u, ns_steps, ns_eps)
    u = normalise(u.unsqueeze(-1), rank).squeeze(-1) * rms_mult
    new_p = value - lr * (u + weight_decay * value)
    return {"p": new_p.reshape(shape), "u": u.reshape(shape), "features": torch.cat(groups, dim=-1),
            "normalised": torch.cat(normed, dim=-1), "direction": direction, "magnitude": magnitude}


def adamw_own(p, g, adam: dict, *, lr, weight_decay, betas=(0.9, 0.95), eps=1e-8):
    """§5.1: CELO2's AdamW with its own moments (``adam``: ``mu``, ``nu``, ``t``, updated). Returns the new p."""
    b1, b2 = (f32(b) for b in betas)
    p = p.to(F64)
    g = g.to(F64)
    adam["t"] += 1
    adam["mu"] = b1 * adam["mu"] + (1 - b1) * g
    adam["nu"] = b2 * adam["nu"] + (1 - b2) * g * g
    direction = (adam["mu"] / (1 - b1 ** adam["t"])) / (torch.sqrt(adam["nu"] / (1 - b2 ** adam["t"])) + eps)
    return p - lr * (direction + weight_decay * p)


def adamw_shared(p, g, state, t, *, lr, weight_decay):
    """§5.2: ELO-CELO2's AdamW on the shared accumulators (updated here), group step ``t``. Returns the new p."""
    accumulate(state, g)
    value = p.to(F64).reshape(state["v"].shape)
    direction = (state["m"][0] / (1 - BETA_M[0] ** t)) / (torch.sqrt(state["v"] / (1 - BETA_V ** t)) + 1e-8)
    return (value - lr * (direction + weight_decay * value)).reshape(p.shape)


# ------------------------------------------------------------------------------------------ conversions


def from_lopt_state(buffers: dict, shape) -> dict:
    """The oracle's float64 state from lopt's (a learned-branch state: mom, rms, fac_vec_*; or CELO2's AdamW
    state: exp_avg, exp_avg_sq, adam_step)."""
    get = lambda name: buffers[name].detach().to("cpu", F64)  # noqa: E731
    if "exp_avg" in buffers:
        return {"mu": get("exp_avg").reshape(shape), "nu": get("exp_avg_sq").reshape(shape), "t": int(buffers["adam_step"])}
    shape = work_shape(shape)
    dims = factored_axes(shape)
    mom = get("mom").reshape(shape + (3,))
    state = {"m": [mom[..., k].clone() for k in range(3)], "v": get("rms").reshape(shape), "R": None, "C": None,
             "V": None}
    if dims is None:
        full = get("fac_vec_v").reshape(shape + (3,))
        state["V"] = [full[..., k].clone() for k in range(3)]
    else:
        state["R"] = [get("fac_vec_row")[..., k].clone() for k in range(3)]
        state["C"] = [get("fac_vec_col")[..., k].clone() for k in range(3)]
    return state


def to_lopt_state(state: dict, shape) -> dict:
    """lopt's layout (float64) of an oracle learned-branch state, for a parameter of ``shape``."""
    shape = tuple(shape)
    empty = torch.zeros(0, dtype=F64)
    out = {"mom": torch.stack(state["m"], dim=-1).reshape(shape + (3,)), "rms": state["v"].reshape(shape + (1,))}
    if state["V"] is not None:
        out.update(fac_vec_row=empty, fac_vec_col=empty, fac_vec_v=torch.stack(state["V"], dim=-1).reshape(shape + (3,)))
    else:
        out.update(fac_vec_row=torch.stack(state["R"], dim=-1), fac_vec_col=torch.stack(state["C"], dim=-1),
                   fac_vec_v=empty)
    return out
