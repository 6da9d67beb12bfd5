"""Which registered optimizers ``lopt.meta`` steps over a population, and the class that steps each.

An optimizer is trainable here when its weights are one plain MLP (``lopt.meta.metaparams``) and a
population-batched step of it exists: :data:`BATCHED` names that class as ``"module:attribute"`` (as
``lopt.registry`` names front-ends), so this module imports none of them until one is asked for.
:func:`inner_rule` reads everything else — the weights' architecture, the ``torch.optim`` class, its
reference module and its constructor defaults — from the optimizer registry, so nothing is restated.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from lopt import registry

# The registered optimizers whose inner step is batched, and the class that batches it.
BATCHED = {
    "small_fc_lopt": "lopt.meta.batched:BatchedSmallFCLOpt",
    "elo": "lopt.meta.batched:BatchedSmallFCLOpt",
    "celo2": "lopt.meta.batched_celo2:BatchedCELO2",
    "elo_celo2": "lopt.meta.batched_celo2:BatchedCELO2",
}
TRAINABLE = tuple(BATCHED)
# What the other registered ones add to such a step, which is not batched here.
NOT_BATCHED = {
    "velo": "an LSTM that writes each tensor's network",
    "mulo": "μP's per-layer scaling of the update, for μP-parametrised models, which lopt.meta's tasks are not",
}


@dataclass(frozen=True)
class InnerRule:
    """One trainable optimizer: its registered name, its weights' architecture (``weights/registry.json``), its
    ``torch.optim`` class, reference module and the constructor defaults the batched step starts from."""

    name: str
    architecture: str
    front_end: type
    reference: object
    defaults: dict

    @property
    def step_mult(self):
        """small_fc_lopt's ``step_mult`` (a constructor option); ELO's update has none (its reference's 1)."""
        return self.defaults.get("step_mult", getattr(self.reference, "STEP_MULT", None))


def inner_rule(optimizer: str) -> InnerRule:
    """The :class:`InnerRule` of ``optimizer`` (a name of :data:`TRAINABLE`); ValueError naming the choices."""
    if optimizer not in TRAINABLE:
        if optimizer not in registry.names():
            what = f"is not a registered optimizer (registered: {', '.join(registry.names())})"
        else:
            what = f"is registered, but its step ({NOT_BATCHED.get(optimizer, 'its own')}) is not batched in lopt.meta"
        raise ValueError(f"lopt.meta steps populations of {', '.join(TRAINABLE)} only (to meta-train or "
                         f"evaluate them); {optimizer!r} {what}")
    entry = registry.get(optimizer)
    front_end = entry.front_end_class
    defaults = {name: p.default for name, p in inspect.signature(front_end.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return InnerRule(optimizer, entry.architecture, front_end, front_end.reference, defaults)


def batched_optimizer(shapes, population: int, device="cpu", *, optimizer: str = "small_fc_lopt", **options):
    """The population-batched step of ``optimizer`` over ``population`` members of parameters ``shapes``
    (:data:`BATCHED`'s class, built with ``options``: ``lr``, ``weight_decay``, ``compiled``, ...)."""
    inner_rule(optimizer)  # (the error naming the choices)
    module_name, attribute = BATCHED[optimizer].split(":")
    cls = getattr(importlib.import_module(module_name), attribute)
    return cls(shapes, population, device, optimizer=optimizer, **options)
