"""VeLO as ``docs/velo.md`` ("Exact semantics") defines it, in float64: the oracle of the VeLO tests.

It imports nothing from lopt and keeps its own state layout (decay axis **first**), so agreement
with ``lopt.reference.velo`` is evidence that both read the definition the same way. Section
numbers refer to docs/velo.md. Rank-0 tensors follow the JAX definition (a 1-element vector, §5).
"""

from __future__ import annotations

import math
import struct

import torch

F64 = torch.float64


def as_float32(x: float) -> float:
    """x rounded to float32 (docs/velo.md's constants are float32 values), returned as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


# §2: the float32 decays (bit patterns 0x3f666666, 0x3f7d70a4, 0x3f7fbe77), as float64 numbers.
MOMENTUM_BETAS = [as_float32(0.9), as_float32(0.99), as_float32(0.999)]
RMS_BETA = as_float32(0.999)
ADAFACTOR_BETAS = [as_float32(0.9), as_float32(0.99), as_float32(0.999)]
FRACTION_SCALES = [0.03, 0.1, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1]


# ----------------------------------------------------------------------------------- §1.2, §3.2


class SpecLossBuffer:
    def __init__(self, num_steps: int):
        top = math.log10(num_steps)
        halflives = [10.0 ** (1.0 + j * (top - 1.0) / 9.0) for j in range(10)]
        self.delta = [as_float32(math.exp(-1.0 / h)) for h in halflives]
        self.mu = [0.0] * 10
        self.rho = [as_float32(999999999999.0)] * 10
        self.n = 0

    def update(self, loss: float) -> None:
        n = self.n
        corrected = [self.mu[j] / (1.0 - self.delta[j] ** (n + 1)) for j in range(10)]
        approx_max = max(corrected) if n > 0 else loss
        clipped = min(2.0 * abs(approx_max), loss)
        self.mu = [self.delta[j] * self.mu[j] + (1.0 - self.delta[j]) * clipped for j in range(10)]
        corrected = [self.mu[j] / (1.0 - self.delta[j] ** (n + 1)) for j in range(10)]
        self.rho = [min(self.rho[j], corrected[j]) for j in range(10)]
        self.n = n + 1

    def features(self) -> list:
        if self.n <= 2:
            return [0.0] * 9
        a = [self.mu[j] / (1.0 - self.delta[j] ** self.n) for j in range(10)]
        out = []
        for j in range(9):
            value = (a[j] - self.rho[j]) / max(1e-8, a[j + 1] - self.rho[j]) - 1.0
            out.append(min(1.0, max(-1.0, value)))
        return out


# ----------------------------------------------------------------------------------- §3.3


def spec_factored_dims(shape):
    """(d1, d0) by the stable size order and PyLO VeLO's swap rule; None below rank 2."""
    rank = len(shape)
    if rank < 2:
        return None
    order = sorted(range(rank), key=lambda axis: (shape[axis], axis))
    a, b = order[-2], order[-1]
    if shape[a] != shape[b]:
        return (a, b)
    if rank == 4 and (a, b) == (0, 1):
        return (0, 1)
    return (b, a)


# ----------------------------------------------------------------------------------- state


def spec_init_state(shape, rnn) -> dict:
    """Zero accumulators with the decay axis first; the LSTM row from the meta-learned init state."""
    s = tuple(shape) if len(shape) else (1,)
    dims = spec_factored_dims(tuple(shape))
    state = {"m": torch.zeros((3,) + s, dtype=F64), "v": torch.zeros(s, dtype=F64)}
    if dims is None:
        state["V"] = torch.zeros((3,) + s, dtype=F64)
    else:
        d1, d0 = dims
        state["R"] = torch.zeros((3,) + tuple(n for i, n in enumerate(s) if i != d0), dtype=F64)
        state["C"] = torch.zeros((3,) + tuple(n for i, n in enumerate(s) if i != d1), dtype=F64)
    state["h"] = rnn["lstm_init_state.0"][0].to(F64).clone()
    state["c"] = rnn["lstm_init_state.1"][0].to(F64).clone()
    return state


# ----------------------------------------------------------------------------------- §3.4


def L(x: float) -> float:
    return 0.5 * min(5.0, max(-5.0, math.log(1e-8 + abs(10.0 * x))))


def spec_lstm_features(p, m, v, t: int, num_steps: int, loss_feats: list, original_shape) -> list:
    """The 30 features of one tensor from the current p and the old m (3, *S) and v (*S)."""
    n_elements = p.numel()
    nu = 1.0 / math.sqrt(max(1e-9, float((p * p).sum()) / n_elements))
    m_scaled = [m[k] * nu for k in range(3)]
    v_scaled = v * nu
    mu_m = [float(m_scaled[k].sum()) / n_elements for k in range(3)]
    var_m = [float(((m_scaled[k] - mu_m[k]) ** 2).sum()) / n_elements for k in range(3)]
    mu_v = float(v_scaled.sum()) / n_elements
    var_v = [float(((v_scaled - mu_m[k]) ** 2).sum()) / n_elements for k in range(3)]
    fraction = t / num_steps
    phi = [math.tanh(10.0 * (fraction - s)) for s in FRACTION_SCALES]
    rank = sum(1 for n in original_shape if n > 1)
    one_hot = [1.0 if r == rank else 0.0 for r in range(5)]
    return phi + list(loss_feats) + [L(mu_v)] + one_hot + [L(x) for x in var_m] + [L(x) for x in var_v]


# ----------------------------------------------------------------------------------- §3.5


def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def spec_controller(X, H, Cc, rnn):
    """X (N, 30), H and Cc (N, 512), all float64 → controls (N, 256), lambda (N,), new H, new C."""
    w = {k: t.to(F64) for k, t in rnn.items()}
    U = torch.relu(X @ w["mix_layer2.weight"].T + w["mix_layer2.bias"])
    u = U.max(dim=0).values
    x_hat = X @ w["final_mix_layer.weight"].T + w["final_mix_layer.bias"] + u
    z = torch.cat([x_hat, H], dim=1) @ w["lstm.linear.weight"].T + w["lstm.linear.bias"]
    z_i, z_g, z_f, z_o = z[:, 0:512], z[:, 512:1024], z[:, 1024:1536], z[:, 1536:2048]
    C_new = sigmoid(z_f + 1.0) * Cc + sigmoid(z_i) * torch.tanh(z_g)
    H_new = sigmoid(z_o) * torch.tanh(C_new)
    controls = H_new @ w["rnn_to_controls.weight"].T + w["rnn_to_controls.bias"]
    lam = (H_new @ w["step_size.weight"].T)[:, 0] + w["step_size.bias"][0]
    return controls, lam, H_new, C_new


# ----------------------------------------------------------------------------------- §3.8


def spec_generate(control, mlp) -> dict:
    """The six MLP arrays 100 · (1/K) Σ_k c_k W^(k) for one control vector (float64)."""
    out = {}
    for name in ("input_weights_", "input_bias_", "hidden_weights_.0", "hidden_bias_.0", "output_weights_", "output_bias_"):
        stack = mlp[name].to(F64)
        K = stack.shape[0]
        total = torch.zeros(stack.shape[1:], dtype=F64)
        for k in range(K):
            total = total + control[k] * stack[k]
        out[name] = 100.0 * (total / K)
    return out


# ----------------------------------------------------------------------------------- §3.3, §3.6–3.9


def _mean_keep(x, axis):
    return x.sum(dim=axis, keepdim=True) / x.shape[axis]


def spec_update_and_features(p, g_hat, state, dims):
    """Update the accumulators (in ``state``) with ĝ and return the 30 raw features, shape (30, *S)."""
    m, v = state["m"], state["v"]
    for k in range(3):
        m[k] = MOMENTUM_BETAS[k] * m[k] + (1.0 - MOMENTUM_BETAS[k]) * g_hat
    state["v"] = v = RMS_BETA * v + (1.0 - RMS_BETA) * g_hat * g_hat
    G = g_hat * g_hat + 1e-30
    rho = 1.0 / torch.sqrt(v + 1e-6)
    fac_g, row_feat, col_feat, fac_m = [], [], [], []
    if dims is None:
        V = state["V"]
        for k in range(3):
            V[k] = ADAFACTOR_BETAS[k] * V[k] + (1.0 - ADAFACTOR_BETAS[k]) * G
            fac_g.append(g_hat / torch.sqrt(torch.clamp(V[k] + 1e-9, min=1e-9)))
            row_feat.append(V[k])
            col_feat.append(V[k])
            fac_m.append(m[k] / torch.sqrt(V[k]))
    else:
        d1, d0 = dims
        R, C = state["R"], state["C"]
        for k in range(3):
            R[k] = ADAFACTOR_BETAS[k] * R[k] + (1.0 - ADAFACTOR_BETAS[k]) * _mean_keep(G, d0).squeeze(d0)
            C[k] = ADAFACTOR_BETAS[k] * C[k] + (1.0 - ADAFACTOR_BETAS[k]) * _mean_keep(G, d1).squeeze(d1)
        for k in range(3):
            r_full = R[k].unsqueeze(d0)  # broadcast along d0
            c_full = C[k].unsqueeze(d1)  # broadcast along d1
            # mean of R over the axis that was d1, taken in full-tensor coordinates
            row_col_mean = _mean_keep(r_full, d1)
            rf = 1.0 / torch.sqrt(torch.clamp(r_full / (row_col_mean + 1e-9), min=1e-9))
            cf = 1.0 / torch.sqrt(torch.clamp(c_full, min=1e-9))
            fac_g.append(g_hat * rf * cf)
            row_feat.append(r_full.expand_as(p))
            col_feat.append(c_full.expand_as(p))
            fac_m.append(m[k] * rf * cf)
    features = [g_hat, torch.clamp(g_hat, -0.1, 0.1), p]
    features += [m[k] for k in range(3)]
    features += [v]
    features += [m[k] * rho for k in range(3)]
    features += [rho]
    features += fac_g
    features += [g_hat * rho]
    features += row_feat
    features += col_feat
    features += [1.0 / torch.sqrt(x + 1e-8) for x in row_feat]
    features += [1.0 / torch.sqrt(x + 1e-8) for x in col_feat]
    features += fac_m
    return torch.stack([f.expand_as(p) for f in features])


def spec_normalise(features):
    n = features[0].numel()
    out = []
    for j in range(features.shape[0]):
        x = features[j]
        out.append(x / torch.sqrt(1e-5 + (x * x).sum() / n))
    return torch.stack(out)


def spec_mlp(features, weights):
    """features (30, *S) → direction, magnitude (each *S)."""
    x = features.reshape(30, -1).T  # (n, 30)
    h1 = torch.relu(x @ weights["input_weights_"].T + weights["input_bias_"])
    h2 = torch.relu(h1 @ weights["hidden_weights_.0"].T + weights["hidden_bias_.0"])
    o = h2 @ weights["output_weights_"].T + weights["output_bias_"]
    shape = features.shape[1:]
    return o[:, 0].reshape(shape), o[:, 1].reshape(shape)


def spec_new_param(p, direction, magnitude, lam, lr, weight_decay, exp_mult=0.001, step_mult=0.001):
    scale = math.sqrt(float((p * p).sum()) / p.numel() + 1e-9)
    u = lam * scale * direction * torch.exp(exp_mult * magnitude) * step_mult
    p_new = p - lr * u
    if weight_decay > 0:
        p_new = p_new - weight_decay * lr * p_new
    return p_new


# ----------------------------------------------------------------------------------- §3.1


class SpecVeLO:
    """A whole VeLO optimizer in float64: ``groups`` is a list of dicts with ``params`` (float64
    tensors, any shape), ``lr``, ``weight_decay`` and optionally ``exp_mult``, ``step_mult``
    (default 0.001 each); ``step(grads, loss)`` takes one gradient per parameter (None = no
    gradient) in group order."""

    def __init__(self, groups, num_steps, weights):
        self.groups = [dict(g, t=0) for g in groups]
        self.num_steps = num_steps
        self.rnn, self.mlp = weights["rnn"], weights["mlp"]
        self.buffer = SpecLossBuffer(num_steps)
        self.state = [[spec_init_state(p.shape, self.rnn) for p in g["params"]] for g in self.groups]
        self.last_lstm_inputs = None

    def step(self, grads, loss: float):
        self.buffer.update(loss)
        loss_feats = self.buffer.features()
        grads = iter(grads)
        rows, entries = [], []
        for gi, group in enumerate(self.groups):
            for pi, p in enumerate(group["params"]):
                g = next(grads)
                if g is None:
                    continue
                shape = tuple(p.shape)
                s = shape if shape else (1,)
                st = self.state[gi][pi]
                g_hat = torch.clamp(g.to(F64).reshape(s), -1000.0, 1000.0)
                rows.append(spec_lstm_features(p.reshape(s), st["m"], st["v"], group["t"], self.num_steps, loss_feats, shape))
                entries.append((gi, pi, g_hat, s))
        if entries:
            X = torch.tensor(rows, dtype=F64)
            self.last_lstm_inputs = X
            H = torch.stack([self.state[gi][pi]["h"] for gi, pi, _, _ in entries])
            Cc = torch.stack([self.state[gi][pi]["c"] for gi, pi, _, _ in entries])
            controls, lam, H_new, C_new = spec_controller(X, H, Cc, self.rnn)
        for group in self.groups:
            group["t"] += 1
        for row, (gi, pi, g_hat, s) in enumerate(entries):
            group, st = self.groups[gi], self.state[gi][pi]
            st["h"], st["c"] = H_new[row], C_new[row]
            p = group["params"][pi]
            p_work = p.reshape(s)
            dims = spec_factored_dims(tuple(p.shape))
            features = spec_normalise(spec_update_and_features(p_work, g_hat, st, dims))
            weights = spec_generate(controls[row], self.mlp)
            direction, magnitude = spec_mlp(features, weights)
            new = spec_new_param(p_work, direction, magnitude, float(lam[row]), group["lr"], group["weight_decay"],
                                 group.get("exp_mult", 0.001), group.get("step_mult", 0.001))
            group["params"][pi] = new.reshape(p.shape)
