"""The one registry of lopt's optimizers: what each is, where its parts live, what it needs.

Everything that lists optimizers reads this table: the package's exports, ``lopt bench`` and the CLI,
the fused launcher (which architectures have kernels), the timm glue, the foreign-state check of
``load_state_dict`` and the generic tests (``tests/test_registry.py``), which therefore apply
to a new optimizer as soon as it is registered here. Entries name their modules as strings and load
them on first use, so this module imports nothing of lopt's and no import circle can pass through it.

A new optimizer is one :class:`OptimizerEntry` below plus the files it names (``docs/adding_an_optimizer.md``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


def _load(path: str):
    """``"package.module:attribute"`` (or a module path alone) imported."""
    module_name, _, attribute = path.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


@dataclass(frozen=True)
class OptimizerEntry:
    """One learned optimizer.

    ``name`` is what the CLI, ``lopt bench`` and timm call it; ``front_end`` the ``torch.optim`` class,
    ``reference`` the module with its readable naive math, ``fused`` its fused engine class (None: naive
    only) — each as ``"module:attribute"``. ``architecture`` is the weights registry's
    (``weights/registry.json``) network description the optimizer loads, ``default_weights`` the
    registered weight set its constructor defaults to. ``required_arguments``: what a constructor
    needs beyond the parameters (e.g. VeLO's ``num_steps``), with a value that tests and benchmarks use.
    ``orthogonalizes``: its matrix updates are orthogonalised (Newton-Schulz) and ``is_embedding`` groups take
    its AdamW branch; ``lopt bench`` then adds the ``muon`` yardstick by default and routes embeddings there.
    ``timm_name``: the name timm knows it by where ``name`` cannot be (timm resolves a name by its last
    ``_`` part, so ``elo_celo2`` would be ``celo2``); empty: ``name``.
    What the front-end class says itself (``requires_loss``, ``GLOBAL_STATE_KEYS``, ``TENSOR_STATE_KEYS``,
    ``PRECISIONS``) is not repeated here.
    """

    name: str
    front_end: str
    reference: str
    fused: str | None
    architecture: str
    default_weights: str
    description: str
    required_arguments: dict = field(default_factory=dict)
    orthogonalizes: bool = False
    timm_name: str = ""

    @property
    def timm_registration_name(self) -> str:
        return self.timm_name or self.name

    @property
    def front_end_class(self) -> type:
        return _load(self.front_end)

    @property
    def reference_module(self):
        return _load(self.reference)

    @property
    def fused_engine_class(self) -> type | None:
        return _load(self.fused) if self.fused else None

    @property
    def class_name(self) -> str:
        return self.front_end.partition(":")[2]

    def build(self, params, **kwargs):
        """The optimizer over ``params`` with its required arguments filled in where not given."""
        return self.front_end_class(params, **{**self.required_arguments, **kwargs})


OPTIMIZERS: dict[str, OptimizerEntry] = {}


def register(entry: OptimizerEntry) -> OptimizerEntry:
    if entry.name in OPTIMIZERS:
        raise ValueError(f"an optimizer named {entry.name!r} is registered already")
    OPTIMIZERS[entry.name] = entry
    return entry


def names() -> list[str]:
    """The registered optimizers' names, in registration order."""
    return list(OPTIMIZERS)


def get(name: str) -> OptimizerEntry:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"no optimizer named {name!r}; lopt has {', '.join(OPTIMIZERS)}") from None


def entry_for(optimizer_or_class) -> OptimizerEntry:
    """The entry of an optimizer instance or class (its own class or the nearest registered base)."""
    cls = optimizer_or_class if isinstance(optimizer_or_class, type) else type(optimizer_or_class)
    by_class = {entry.class_name: entry for entry in OPTIMIZERS.values()}
    for klass in cls.__mro__:
        entry = by_class.get(klass.__name__)
        if entry is not None and entry.front_end_class is klass:
            return entry
    raise ValueError(f"{cls.__name__} is not a registered lopt optimizer")


def fused_architectures() -> tuple:
    """Weights architectures that have a fused engine."""
    return tuple(entry.architecture for entry in OPTIMIZERS.values() if entry.fused)


register(OptimizerEntry(
    name="small_fc_lopt",
    front_end="lopt.optimizers.small_fc_lopt:SmallFCLOpt",
    reference="lopt.reference.small_fc_lopt",
    fused="lopt.fused.small_fc_lopt:SmallFCLOptFused",
    architecture="small_fc_lopt",
    default_weights="small_fc_lopt",
    description="small_fc_lopt: a learned per-element MLP optimizer (lr=1.0 is the meta-trained step)",
))
register(OptimizerEntry(
    name="velo",
    front_end="lopt.optimizers.velo:VeLO",
    reference="lopt.reference.velo",
    fused="lopt.fused.velo:VeLOFused",
    architecture="velo",
    default_weights="velo",
    description="VeLO: a learned optimizer that schedules itself; needs num_steps= and the loss "
                "(VeLO.accumulate_loss or step(loss))",
    required_arguments={"num_steps": 300},
))
register(OptimizerEntry(
    name="celo2",
    front_end="lopt.optimizers.celo2:CELO2",
    reference="lopt.reference.celo2",
    fused="lopt.fused.celo2:CELO2Fused",
    architecture="celo2",
    default_weights="celo2",
    description="CELO2: a learned per-element MLP step orthogonalised by Newton-Schulz, AdamW for embeddings and "
                "rank <= 1 (lr is Adam-like: 1e-3)",
    orthogonalizes=True,
))
register(OptimizerEntry(
    name="elo_celo2",
    front_end="lopt.optimizers.celo2:ELO_CELO2",
    reference="lopt.reference.celo2",
    fused="lopt.fused.celo2:CELO2Fused",
    architecture="celo2",
    default_weights="elo-celo2",
    description="ELO-CELO2: CELO2 with ELO-trained weights, weight decay 0.1, global clipping at 1.0 and AdamW on "
                "the shared accumulators (lr is Adam-like: 1e-3)",
    orthogonalizes=True,
    timm_name="elocelo2",
))
register(OptimizerEntry(
    name="elo",
    front_end="lopt.optimizers.elo:ELO",
    reference="lopt.reference.elo",
    fused="lopt.fused.elo:ELOFused",
    architecture="elo",
    default_weights="elo",
    description="ELO: small_fc_lopt's per-element MLP with raw decays and its own update (lr=1e-3 is its step)",
))
register(OptimizerEntry(
    name="mulo",
    front_end="lopt.optimizers.mulo:MuLO",
    reference="lopt.reference.small_fc_lopt",
    fused="lopt.fused.small_fc_lopt:SmallFCLOptFused",
    architecture="small_fc_lopt",
    default_weights="small_fc_lopt",
    description="MuLO: small_fc_lopt under muP, lr / width_mult for matrix-like parameters (needs mup's infshape)",
    required_arguments={"missing_infshape": "finite"},  # (plain tensors in tests and lopt bench: lr unchanged)
))
