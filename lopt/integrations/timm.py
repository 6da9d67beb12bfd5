"""timm glue: one call registers lopt's optimizers with ``timm.optim.create_optimizer_v2``.

::

    from lopt.integrations.timm import register_timm_optimizers
    register_timm_optimizers()
    opt = timm.optim.create_optimizer_v2(model, "small_fc_lopt", weight_decay=0.05)
    opt = timm.optim.create_optimizer_v2(model, "velo", num_steps=10_000)

timm reads an optimizer name as ``[lookahead_]..._<key>``: it looks up only the part after the
last ``_`` (``"small_fc_lopt"`` → ``"lopt"``) and ignores the rest except a leading
``lookahead_``. So each optimizer is registered under its full name (for ``list_optimizers`` and
``get_optimizer_class``) and under that last part (for ``create_optimizer_v2``); a last part
already taken by a different optimizer is refused rather than overwritten. timm is imported only
when a function here is called.
"""

from __future__ import annotations

from lopt import registry as lopt_registry

__all__ = ["register_timm_optimizers", "register_timm_optimizer", "timm_lookup_key", "timm_names"]

_LOOKAHEAD_PREFIX = "lookahead"


def timm_lookup_key(name: str) -> str:
    """The registry key ``create_optimizer_v2(model, name)`` looks up: the part after the last ``_``, lower case.

    Raises ValueError for names timm cannot resolve to one optimizer of their own.
    """
    if not isinstance(name, str) or not name.strip("_"):
        raise ValueError(f"a timm optimizer name must be a non-empty string, got {name!r}")
    parts = name.lower().split("_")
    if any(not part for part in parts):
        raise ValueError(f"timm optimizer name {name!r} has an empty part between '_'s; timm splits names on '_'")
    if parts[0] == _LOOKAHEAD_PREFIX:
        raise ValueError(f"timm optimizer name {name!r} starts with 'lookahead_', which timm reads as 'wrap in "
                         f"Lookahead'; register the plain name and ask for 'lookahead_<name>' instead")
    return parts[-1]


def register_timm_optimizer(name: str, optimizer_class, description: str = "", *, defaults: dict | None = None,
                            registry=None) -> str:
    """Register ``optimizer_class`` with timm as ``name``; returns the key ``create_optimizer_v2`` resolves it by.

    ``defaults`` are keyword arguments timm passes unless the caller gives them (e.g.
    ``{"weights": "/path/to/weights"}``). ``registry`` defaults to timm's default registry. Registering
    the same thing twice is a no-op; a key taken by a different optimizer raises ValueError.
    """
    OptimInfo, registry = _timm_registry(registry)
    key = timm_lookup_key(name)
    info = OptimInfo(name=name.lower(), opt_class=optimizer_class, description=description, has_eps=False,
                     has_momentum=False, has_betas=False, defaults=dict(defaults) if defaults else None)
    for taken_name in {name.lower(), key}:
        existing = _registered(registry, taken_name)
        if existing is not None and _registration(existing) != _registration(info):
            raise ValueError(
                f"cannot register {name!r} with timm: create_optimizer_v2 looks names up by their last '_' part "
                f"({key!r}), and {taken_name!r} is already {existing.name!r} ({_describe(existing.opt_class)}). "
                f"Choose a name whose last '_' part is not taken, e.g. {name.replace('_', '')!r}")
    if _registered(registry, info.name) is None:
        registry.register(info)
    if _registered(registry, key) is None:
        registry.register_alias(key, info.name)
    return key


def register_timm_optimizers(registry=None) -> list[str]:
    """Register every optimizer of lopt's registry with timm, each under its ``timm_registration_name``:
    the registry's name, except ``"elocelo2"`` for ELO-CELO2 (timm would read ``elo_celo2`` as ``celo2``).

    Afterwards ``timm.optim.create_optimizer_v2(model, "small_fc_lopt", ...)``, ``(model, "velo",
    num_steps=...)``, ``(model, "elocelo2")`` build them (timm's weight-decay groups included). Returns the
    registered names. Idempotent.
    """
    names = timm_names()
    for name, entry in zip(names, lopt_registry.OPTIMIZERS.values()):
        register_timm_optimizer(name, entry.front_end_class, f"lopt {entry.description}", registry=registry)
    return names


def timm_names() -> list[str]:
    """The names :func:`register_timm_optimizers` registers, in registry order. Raises ValueError where two
    optimizers would share the part of the name timm looks up (checked without timm)."""
    names = [entry.timm_registration_name for entry in lopt_registry.OPTIMIZERS.values()]
    owners: dict[str, str] = {}
    for name in names:
        key = timm_lookup_key(name)
        if owners.setdefault(key, name) != name:
            raise ValueError(f"lopt's registry gives timm {owners[key]!r} and {name!r}, which timm both looks up as "
                             f"{key!r}; set a distinct timm_name on one of them (lopt/registry.py)")
    return names


def _timm_registry(registry):
    try:
        from timm.optim import OptimInfo
        from timm.optim._optim_factory import default_registry
    except Exception as err:  # ImportError, or e.g. a torchvision built for another torch: RuntimeError
        # "operator torchvision::nms does not exist" (timm imports torchvision)
        raise ImportError(f"lopt.integrations.timm needs a working timm (and the torchvision built for this torch, "
                          f"which timm imports): importing it failed with {type(err).__name__}: {err}") from err
    return OptimInfo, registry if registry is not None else default_registry


def _registered(registry, name: str):
    try:
        return registry.get_optimizer_info(name)
    except ValueError:  # timm's "Optimizer ... not found in registry"
        return None


def _registration(info) -> tuple:
    return (info.opt_class, info.defaults, info.has_eps, info.has_momentum, info.has_betas)


def _describe(opt_class) -> str:
    return opt_class if isinstance(opt_class, str) else f"{opt_class.__module__}.{opt_class.__qualname__}"
