"""CELO2 and ELO-CELO2 stepped over a population: every tensor carries a leading population axis ``P``.

:class:`BatchedCELO2` computes, for every population member, the step ``lopt.CELO2(backend="naive")`` (or
``lopt.ELO_CELO2``) computes for that member's parameters (docs/celo2.md), each member with its own
meta-weights and its own step count. It is the reference functions of ``lopt/reference/celo2.py`` called on
``(P,) + S`` tensors wherever their broadcasting allows:

* the accumulators and the 30 (or 15) per-element features reduce along the member's own axes (the factored
  axes shifted by one);
* every normalisation of CELO2 runs over a tensor's last two axes (§3.4, §3.7) and Newton–Schulz works on a
  stack of matrices (§3.6), so for a member tensor of rank >= 2 the leading ``P`` is one more batch axis of
  the reference functions themselves; a learned-branch tensor of rank <= 1 (``use_adamw_for_1d=False``) is
  carried as ``(P, 1, n)``, whose last two axes are the member's one (and it is not orthogonalised);
* the split-input MLP multiplies every member by its own weights (:func:`batched_mlp`);
* the global norm (``max_grad_norm``) and the AdamW branch's bias corrections are formed per member.

The task models of ``lopt.meta`` have no embeddings, so the AdamW branch takes exactly the tensors of rank
<= 1 (with ``use_adamw_for_1d``), as ``lopt.CELO2(model.parameters())`` does. A member whose gradients hold a
non-finite value (or ``|g| >= 2^64``) changes nothing that step, as the optimizer's ``nonfinite="skip"``.
``tests/test_meta_batched.py`` checks each member against the optimizer step by step.
"""

from __future__ import annotations

import torch

from lopt.meta.batched import PopulationStep, _shifted
from lopt.meta.rules import inner_rule
from lopt.reference import accumulators
from lopt.reference import celo2 as reference

# The constructor options of the optimizers' classes that the batched step takes (their defaults where absent).
OPTIONS = ("orthogonalize", "adam_lr_mult", "adam_weight_decay", "adam_betas", "adam_eps", "use_adamw_for_1d",
           "max_grad_norm", "grad_clip_value", "exp_mult", "rms_mult", "param_scale_mult", "momentum_decays",
           "rms_decays", "adafactor_decays", "ns_coefficients", "ns_steps", "ns_eps")


def batched_first_layer_weight(network: dict, inputs: int) -> torch.Tensor:
    """``reference.first_layer_weight`` per member: the groups' weights stacked in input order, ``(P, inputs,
    hidden)`` from batched pieces ``(P, width, hidden)``, or the shared ``(inputs, hidden)``."""
    pieces, rows, index = [], 0, 0
    while rows < inputs:
        piece = network[reference.FIRST_LAYER.format(index)]
        pieces.append(piece)
        rows += piece.shape[-2]
        index += 1
    return torch.cat(pieces, dim=-2)


def batched_mlp(inputs: torch.Tensor, network: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.mlp`` per member: ``inputs`` (P, ..., 30 or 15); every tensor of ``network`` batched
    ``(P,) + shape`` or shared ``shape``. Returns (direction, magnitude), each ``inputs.shape[:-1]``."""

    def bias(b):
        return b.unsqueeze(-2) if b.dim() == 2 else b  # (P, out): one row per member, over its N elements

    x = inputs.reshape(inputs.shape[0], -1, inputs.shape[-1])  # (P, N, F): one product per member
    hidden = torch.relu(x @ batched_first_layer_weight(network, x.shape[-1]) + bias(network[reference.FIRST_BIAS]))
    layers = reference.dense_layer_count(network)
    for j in range(layers):
        hidden = hidden @ network[reference.DENSE_WEIGHT.format(j)] + bias(network[reference.DENSE_BIAS.format(j)])
        if j != layers - 1:
            hidden = torch.relu(hidden)
    return hidden[..., 0].reshape(inputs.shape[:-1]), hidden[..., 1].reshape(inputs.shape[:-1])


def member_sums(x: torch.Tensor) -> torch.Tensor:
    """Σ x² per member in float64: (P,)."""
    return accumulators.float64_square_sum(x.reshape(x.shape[0], -1), dim=1)


def per_member(values: torch.Tensor, dims: int) -> torch.Tensor:
    """A (P,) tensor shaped to broadcast over a ``dims``-dimensional population tensor."""
    return values.view((-1,) + (1,) * (dims - 1))


class BatchedCELO2(PopulationStep):
    """CELO2 (or ELO-CELO2) stepped for ``population`` members at once (tensors ``(P,) + S``).

    Args:
        shapes: the per-member parameter shapes ``S`` (any rank; 0-d is the 1-element vector of docs/celo2.md).
        population: ``P``.
        device: where state lives.
        optimizer: ``"celo2"`` (``lopt.CELO2``'s step) or ``"elo_celo2"`` (``lopt.ELO_CELO2``'s).
        lr, weight_decay and the names of :data:`OPTIONS`: as the optimizer's class, whose defaults apply where
            None or absent (ELO-CELO2 takes no ``adam_betas`` or ``adam_eps``). ``lr`` may also be a tensor, 0-d
            (every member's) or (P,) (one per member), read in place at every step (a schedule writes it).

    The state (:meth:`init_state`): ``"step"`` (P,) int64 (``group["step"]``, which is also every AdamW-branch
    tensor's ``adam_step``: each step moves every tensor) and ``"tensors"``, one dict per parameter with the
    optimizer's buffers (the accumulators; CELO2's AdamW-branch tensors ``exp_avg`` and ``exp_avg_sq`` instead),
    each with the leading axis P.
    """

    def __init__(self, shapes, population: int, device="cpu", *, optimizer: str = "celo2", lr=None,
                 weight_decay=None, skip_nonfinite: bool = True, compiled: bool = False, **options):
        self.rule = inner_rule(optimizer)
        defaults = self.rule.defaults
        unknown = sorted(set(options) - {name for name in OPTIONS if name in defaults})
        if unknown:
            raise ValueError(f"BatchedCELO2: {self.rule.front_end.__name__} takes no {', '.join(unknown)}")
        settings = {name: defaults[name] if options.get(name) is None else options[name]
                    for name in OPTIONS if name in defaults}
        if settings["adam_weight_decay"] is None:
            settings["adam_weight_decay"] = defaults["weight_decay"] if weight_decay is None else weight_decay
        self.settings = settings
        self.own_adam_moments = self.rule.front_end._OWN_ADAM_MOMENTS
        self.decays = reference.Decays.from_offsets(settings["momentum_decays"], settings["rms_decays"],
                                                    settings["adafactor_decays"]).to(device)
        super().__init__(shapes, population, device, lr=defaults["lr"] if lr is None else lr,
                         weight_decay=defaults["weight_decay"] if weight_decay is None else weight_decay,
                         skip_nonfinite=skip_nonfinite, compiled=compiled)
        self.adamw = [bool(settings["use_adamw_for_1d"]) and len(s) <= 1 for s in self.shapes]
        # the member's work shape: itself (rank >= 2), (1, n) for a learned vector, (n,) for an AdamW vector
        self.work_shapes = [s if len(s) >= 2 else ((s or (1,)) if adamw else (1,) + (s or (1,)))
                            for s, adamw in zip(self.shapes, self.adamw)]
        self.dims = [_shifted(reference.factored_dims(s)) for s in self.shapes]  # (None below rank 2)

    def init_state(self) -> dict:
        tensors = []
        for shape, work, dims, adamw in zip(self.shapes, self.work_shapes, self.dims, self.adamw):
            full = (self.population,) + work
            if adamw and self.own_adam_moments:
                buffers = {key: torch.zeros(full) for key in reference.ADAM_KEYS}
            else:
                buffers = accumulators.init_state(full, dims)
            tensors.append({k: v.to(self.device) for k, v in buffers.items()})
        return {"step": torch.zeros(self.population, dtype=torch.int64, device=self.device), "tensors": tensors}

    def _gradients(self, grads) -> list:
        """§3.1 per member: the global-norm clip (``max_grad_norm``) over the member's gradients, then the element
        clamp; float32, in the work shapes, with the trailing axis of size 1 the accumulators take."""
        P, s = self.population, self.settings
        grads = [g.detach().to(torch.float32).reshape((P,) + work) for g, work in zip(grads, self.work_shapes)]
        scale = None
        if s["max_grad_norm"] is not None:
            norm = reference.global_norm(sum(member_sums(g) for g in grads))
            # reference.clip_scale per member, max_norm / max(norm, max_norm) in float32, with the limit filled on
            # the device (a tensor built from a host number is a copy, which a CUDA graph's capture refuses)
            limit = torch.full_like(norm, s["max_grad_norm"])
            scale = limit / torch.maximum(norm, limit)
        return [reference.clip_gradient(g, per_member(scale, g.dim()) if scale is not None else None,
                                        s["grad_clip_value"]).unsqueeze(-1) for g in grads]

    def _learned_value(self, value, grad, buffers, dims, rank: int, network: dict) -> torch.Tensor:
        """§3.3–§3.8 for one tensor of every member (``value`` (P,) + work shape, pre-update)."""
        s = self.settings
        features = reference.per_element_features(grad, value.unsqueeze(-1), buffers, dims)
        scale = None
        if s["param_scale_mult"]:  # (per member: the float64 Σ p² over each member's own elements)
            square_sums = accumulators.float64_sum(accumulators.finite_part(value).reshape(len(value), -1) ** 2, dim=1)
            scale = per_member(reference.param_scale(value, square_sums, value[0].numel()), value.dim())
        step = reference.proposed_step(reference.normalise_over_last_axes(features), network, exp_mult=s["exp_mult"],
                                       scale=scale, network_fn=batched_mlp)
        if s["orthogonalize"] and rank >= 2:
            step = reference.orthogonalise(step, s["ns_coefficients"], s["ns_steps"], s["ns_eps"])
        update = reference.finish_step(step, s["rms_mult"])
        return reference.apply_step(value, update, self.member_lr(value.dim()), self.weight_decay)

    def _adamw_value(self, value, grad, buffers, step) -> torch.Tensor:
        """§5 for one tensor of every member: CELO2's own moments (§5.1) or ELO-CELO2's shared accumulators
        (§5.2, already updated), bias-corrected by each member's own step count."""
        s = self.settings
        if self.own_adam_moments:
            exp_avg, exp_avg_sq = (buffers[key] for key in reference.ADAM_KEYS)
            reference.update_adam_moments(exp_avg, exp_avg_sq, grad, s["adam_betas"])
            (beta1, beta2), eps = s["adam_betas"], s["adam_eps"]
        else:
            exp_avg, exp_avg_sq = buffers["mom"][..., 0], buffers["rms"][..., -1]
            beta1, beta2, eps = self.decays.momentum[0], self.decays.rms[-1], reference.SHARED_ADAM_EPSILON
        direction = reference.adam_direction(exp_avg, exp_avg_sq, beta1, beta2, per_member(step, value.dim()), eps)
        lr = s["adam_lr_mult"] * self.member_lr(value.dim())
        return reference.apply_step(value, direction, lr, s["adam_weight_decay"])

    def _step(self, params, grads, state: dict, network: dict) -> list:
        P = self.population
        ok = self.finite_members(grads) if self.skip_nonfinite else None
        step = state["step"] + (ok.to(torch.int64) if ok is not None else 1)
        grads = self._gradients(grads)
        new_params = []
        for i, (p, grad, shape, dims, adamw) in enumerate(zip(params, grads, self.shapes, self.dims, self.adamw)):
            value = p.detach().to(torch.float32).reshape(grad.shape[:-1])
            buffers = state["tensors"][i]
            old = {k: v.clone() for k, v in buffers.items() if v.numel()} if ok is not None else None
            if not (adamw and self.own_adam_moments):
                accumulators.update_accumulators(buffers, grad, self.decays, dims)
            if adamw:
                new = self._adamw_value(value, grad.squeeze(-1), buffers, step)
            else:
                new = self._learned_value(value, grad, buffers, dims, len(shape), network)
            if ok is not None:
                for name, buf in old.items():
                    buffers[name].copy_(self.keep_where(ok, buffers[name], buf))
                new = self.keep_where(ok, new, value)
            new_params.append(new.reshape((P,) + shape))
        state["step"].copy_(step)  # in place: a captured step keeps reading and writing the same tensor
        return new_params
