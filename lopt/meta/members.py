"""A population stepped by the product's own optimizers: one ``torch.optim`` optimizer per member.

:class:`BatchedSmallFCLOpt` steps every member at once with plain tensor operations, each member with its own
meta-weights — what meta-training needs. Evaluating one fixed weight set needs neither: every member runs
the same network. :class:`MemberOptimizers` then gives each member the optimizer a user would construct
(``lopt.SmallFCLOpt`` or ``lopt.ELO``, any backend: ``"auto"`` is the fused CUDA step on a GPU) over views of
the population's tensors, so ``lopt meta-eval --learned-backend`` measures the step users run, at the fused
engine's speed, instead of the batched step's hundreds of small kernels per step.

Every member has its own optimizer, so its non-finite policy (``nonfinite="skip"``: a step whose gradients
hold a non-finite value changes nothing) acts per member, as :class:`BatchedSmallFCLOpt`'s does; one
optimizer over all members would let one diverging member freeze the others. The optimizers keep their
state on the device, count steps there and allocate nothing after their first step, so a
:class:`~lopt.meta.stepper.PopulationStepper` can capture the step in a CUDA graph as it captures the batched
one. ``tests/test_meta_members.py`` checks the members against :class:`BatchedSmallFCLOpt`.
"""

from __future__ import annotations

import warnings

from lopt.meta.rules import inner_rule

BACKENDS = ("auto", "naive", "fused")


class MemberOptimizers:
    """``population`` members, member ``m`` stepped by ``front_end([p[m] for p in params], lr, weights, backend)``.

    Args:
        population: ``P``; the population's tensors are ``(P,) + S``.
        optimizer: a name of :data:`lopt.meta.rules.TRAINABLE`.
        weights: the meta-weights every member runs (a :class:`lopt.weights.MetaWeights`, a name, a directory).
        lr: the optimizer's lr (None: its class's default): a number, or a 0-d floating-point tensor on the
            population's device that every member's optimizer shares and reads in place at every step (the
            naive and fused backends do), so that a schedule writing ``self.lr`` between steps
            (``lopt.meta.evaluate.train_population``'s ``lr_schedule``) moves every member, also from a captured
            CUDA graph.
        backend: the optimizer's ``backend`` (``"auto"``, ``"naive"`` or ``"fused"``).

    The same interface as :class:`BatchedSmallFCLOpt` for :class:`~lopt.meta.stepper.PopulationStepper`:
    :meth:`init_state` and :meth:`step`. The optimizers are built at the first step, over views of the
    tensors the stepper updates (so their state follows those tensors for the whole run); ``network`` is
    None, since the weights live inside the optimizers.
    """

    network = None

    def __init__(self, population: int, *, optimizer: str = "small_fc_lopt", weights, lr=None, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"MemberOptimizers: backend={backend!r}; choose one of {', '.join(BACKENDS)}")
        self.rule = inner_rule(optimizer)
        self.population = int(population)
        self.weights = weights
        self.lr = self.rule.defaults["lr"] if lr is None else lr
        self.backend = backend
        self.optimizers = None
        self._views = None

    def init_state(self) -> dict:
        return {}

    def _bind(self, params) -> None:
        # views of the stepper's own tensors (a detached leaf shares its storage): the optimizers' parameters
        # for the whole run, whatever tensor objects later steps pass
        self._views = [[p.detach()[m] for p in params] for m in range(self.population)]
        self.optimizers = [self.rule.front_end(views, lr=self.lr, weights=self.weights, backend=self.backend)
                           for views in self._views]

    def step(self, params, grads, state: dict, network=None) -> list:
        """Member ``m``'s optimizer steps its views with ``grads[i][m]``, in place; returns ``params``' storage
        (which the stepper then need not copy)."""
        if len(params) != len(grads) or any(p.shape[:1] != (self.population,) for p in params):
            raise ValueError(f"MemberOptimizers: expected one gradient per parameter, each of a population of "
                             f"{self.population} on its first axis")
        if self.optimizers is None:
            self._bind(params)
        with warnings.catch_warnings():
            # a diverging member skips its steps silently, as in the batched step: the evaluation counts it
            warnings.filterwarnings("ignore", message=r".*step skipped because", category=RuntimeWarning)
            for m, (views, optimizer) in enumerate(zip(self._views, self.optimizers)):
                for view, grad in zip(views, grads):
                    view.grad = grad[m]
                optimizer.step()
                for view in views:
                    view.grad = None
        return [p.detach() for p in params]

    @property
    def backends(self) -> list:
        """The backend each member's optimizer resolved to (after the first step)."""
        return [] if self.optimizers is None else [o.backend for o in self.optimizers]
