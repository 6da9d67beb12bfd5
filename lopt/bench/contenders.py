"""The contenders ``lopt bench`` times, how each is built, and why one cannot run here.

* ``adamw``: ``torch.optim.AdamW`` (``fused=True`` on CUDA, ``foreach=True`` on the CPU), the yardstick.
* ``muon``: ``torch.optim.Muon`` for the 2-d parameters that are not embeddings, ``adamw`` for the rest: the
  yardstick of the orthogonalising optimizers (``orthogonalizes`` in the registry: CELO2, ELO-CELO2),
  selected by default when one of them is benchmarked.
* ``naive``: the learned optimizer's plain-PyTorch backend.
* ``naive+compile``: the naive backend with ``step`` under ``torch.compile`` (compile time reported apart).
* ``fused``: the fused backend. Whether it runs is asked of the optimizer itself: constructing it
  with ``backend="fused"`` either works or raises with the reason, which is reported.
* ``fused-fast``: the fused backend with ``precision="fast"`` (optimizers that offer it: small_fc_lopt).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from lopt import registry
from lopt.weights import UntrainedWeightsWarning

CONTENDERS = ("adamw", "muon", "naive", "naive+compile", "fused", "fused-fast")
DEFAULT_CONTENDERS = ("adamw", "naive", "fused")
YARDSTICKS = ("adamw", "muon")  # contenders that are not the learned optimizer (one row per parameter set)
LEARNED_CONTENDERS = ("naive", "naive+compile", "fused", "fused-fast")
FUSED_CONTENDERS = {"fused": {}, "fused-fast": {"precision": "fast"}}  # the optimizer's options for each
# Contenders whose first step is checked against the naive backend's (one step from identical state).
CHECKED_CONTENDERS = ("naive+compile", "fused", "fused-fast")

NOT_SELECTED_FAST = ("not selected: the fused backend with precision='fast' (BF16 products: small_fc_lopt's MLP, "
                     "CELO2's Newton-Schulz; the optimizer's docs) is opt-in; add it with --backends ...,fused-fast")
NOT_SELECTED_COMPILE = ("not selected: compiling the naive step takes minutes on large parameter sets (the graph "
                        "unrolls every tensor); add it with --backends ...,naive+compile")

# The planned training length VeLO is constructed with when only the step time matters.
TIMING_NUM_STEPS = 10_000


def adamw_backend(device: torch.device) -> str:
    return "fused" if device.type == "cuda" else "foreach"


def orthogonalizes(optimizer_name: str) -> bool:
    """Whether the optimizer orthogonalises its matrix updates (``orthogonalizes`` in its registry entry)."""
    return registry.get(optimizer_name).orthogonalizes


def default_contenders(optimizer_names) -> tuple:
    """DEFAULT_CONTENDERS, with ``muon`` when an orthogonalising optimizer is benchmarked."""
    if any(orthogonalizes(name) for name in optimizer_names):
        return tuple(c for c in CONTENDERS if c in DEFAULT_CONTENDERS or c == "muon")
    return DEFAULT_CONTENDERS


def routed_groups(params, embeddings=None) -> list:
    """``params`` as ``lopt.param_groups_for`` routes them: a first group, then the ``embeddings`` (flags
    per parameter; None: none) in a group with ``is_embedding=True``. Empty groups are left out."""
    params = list(params)
    flags = list(embeddings) if embeddings is not None else [False] * len(params)
    groups = [{"params": [p for p, e in zip(params, flags) if not e]},
              {"params": [p for p, e in zip(params, flags) if e], "is_embedding": True}]
    return [group for group in groups if group["params"]]


def make_learned_optimizer(optimizer_name: str, params, backend: str, weights, *, num_steps: int = TIMING_NUM_STEPS,
                           options: dict | None = None, embeddings=None):
    """``lopt.<Optimizer>(params, weights=weights, backend=backend, **options)``, with the registry's required
    arguments (VeLO's ``num_steps``: ``num_steps`` here). ``embeddings``: flags per parameter; an orthogonalising
    optimizer gets them as an ``is_embedding`` group (``routed_groups``), the others the parameters as they are."""
    entry = registry.get(optimizer_name)
    cls = entry.front_end_class
    if entry.orthogonalizes and embeddings is not None:
        params = routed_groups(params, embeddings)
    kwargs = {name: num_steps if name == "num_steps" else value for name, value in entry.required_arguments.items()}
    with warnings.catch_warnings():
        # Untrained weights are timed on purpose (the run's header says "timing only" once).
        warnings.filterwarnings("ignore", category=UntrainedWeightsWarning)
        return cls(params, weights=weights, backend=backend, **kwargs, **(options or {}))


def unsupported_options(optimizer_name: str, contender: str) -> str | None:
    """Why ``optimizer_name`` has no options of ``contender`` (None: it has them, or there are none)."""
    cls = registry.get(optimizer_name).front_end_class
    parameters = inspect.signature(cls).parameters
    missing = [name for name in FUSED_CONTENDERS.get(contender, {}) if name not in parameters]
    if missing:
        return f"{cls.__name__} has no {', '.join(missing)} option"
    return None


def make_adamw(params, device: torch.device) -> torch.optim.Optimizer:
    backend = adamw_backend(device)
    return torch.optim.AdamW(params, lr=1e-3, fused=backend == "fused", foreach=backend == "foreach")


def muon_unavailable_reason() -> str | None:
    """Why the ``muon`` contender cannot run (None: it can)."""
    if not hasattr(torch.optim, "Muon"):
        return f"torch {torch.__version__} has no torch.optim.Muon (PyTorch 2.9 added it)"
    return None


class MuonWithAdamW:
    """``torch.optim.Muon`` for the 2-d parameters that are not embeddings, AdamW (``make_adamw``) for the rest,
    stepped one after the other. Muon's learning rate is AdamW-like (``adjust_lr_fn="match_rms_adamw"``, lr 1e-3,
    as CELO2's); the other hyperparameters are torch's defaults."""

    def __init__(self, params, device: torch.device, embeddings=None):
        params = list(params)
        flags = list(embeddings) if embeddings is not None else [False] * len(params)
        matrices = [p for p, e in zip(params, flags) if p.dim() == 2 and not e]
        rest = [p for p, e in zip(params, flags) if not (p.dim() == 2 and not e)]
        self.optimizers = []
        if matrices:
            self.optimizers.append(torch.optim.Muon(matrices, lr=1e-3, adjust_lr_fn="match_rms_adamw"))
        if rest:
            self.optimizers.append(make_adamw(rest, device))

    @property
    def param_groups(self) -> list:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def step_function(optimizer, compiled: bool = False) -> Callable:
    """``step(loss)``: one optimizer step, passing the loss only to optimizers that need it (VeLO).

    ``compiled``: the optimizer's ``step`` under ``torch.compile``. ``dynamic=True`` because a
    step counter that is a Python int changes every step (static compilation would recompile for
    each value until dynamo's recompile limit, then fall back to eager); the first compiled step
    under the default ``nonfinite="skip"`` turns the counters into tensors, whose values never recompile.
    """
    step = torch.compile(optimizer.step, dynamic=True) if compiled else optimizer.step
    if getattr(type(optimizer), "requires_loss", False):
        return lambda loss: step(loss)
    return lambda loss: step()


@dataclass
class Contender:
    """One contender set up on some parameters: its optimizer and its step function."""

    optimizer_name: str  # small_fc_lopt, velo, ..., adamw or muon
    name: str  # adamw, muon, naive, naive+compile, fused
    backend: str  # what ran: the lopt backend, or AdamW's fused/foreach (muon: "muon+adamw-<that>")
    optimizer: object
    step: Callable
    embeddings: list | None = None  # flags per parameter, as the optimizer was built with


def make_contender(optimizer_name: str, contender: str, params, weights, device, *,
                   num_steps: int = TIMING_NUM_STEPS, options: dict | None = None, embeddings=None) -> Contender:
    """``options``: the learned optimizer's hyperparameters (e.g. ``lr``), for every learned contender.
    ``embeddings``: flags per parameter (``lopt.param_sets.embedding_flags``), for ``muon`` and the
    orthogonalising optimizers' routing."""
    if contender == "adamw":
        adamw = make_adamw(params, device)
        return Contender("adamw", "adamw", adamw_backend(device), adamw, step_function(adamw))
    if contender == "muon":
        muon = MuonWithAdamW(params, device, embeddings)
        return Contender("muon", "muon", f"muon+adamw-{adamw_backend(device)}", muon, step_function(muon), embeddings)
    backend = "fused" if contender in FUSED_CONTENDERS else "naive"
    optimizer = make_learned_optimizer(optimizer_name, params, backend, weights, num_steps=num_steps,
                                       options={**(options or {}), **FUSED_CONTENDERS.get(contender, {})},
                                       embeddings=embeddings)
    return Contender(optimizer_name, contender, contender, optimizer,
                     step_function(optimizer, compiled=contender == "naive+compile"), embeddings)


_FUSED_PREFIX = re.compile(r"^\w+\(backend='fused'\) cannot run: ")


def short_reason(err: BaseException) -> str:
    """An exception as one line, without the constructor's ``X(backend='fused') cannot run:`` preamble."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return _FUSED_PREFIX.sub("", text)


def fused_unavailable_reason(optimizer_name: str, weights, device: torch.device, contender: str = "fused") -> str | None:
    """Why the fused backend of ``optimizer_name`` cannot run on ``device`` (None: it can).

    On CUDA the optimizer is constructed on a small probe tensor with ``backend="fused"`` and the
    error it raises, if any, is the reason; so a fused backend that lands later is picked up as is.
    """
    unsupported = unsupported_options(optimizer_name, contender)
    if unsupported:
        return unsupported
    entry = registry.get(optimizer_name)
    if entry.fused is None:  # (naive only, whatever the device)
        return f"lopt has no fused kernels for {entry.architecture} yet"
    if device.type != "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device is available to PyTorch"
        return "the fused backend needs parameters on a CUDA device (this run is on the CPU: --device cpu)"
    probe = [torch.nn.Parameter(torch.ones(8, 4, device=device))]
    try:
        make_learned_optimizer(optimizer_name, probe, "fused", weights, options=FUSED_CONTENDERS[contender])
    except Exception as err:
        return short_reason(err)
    return None


def availability(optimizer_name: str, contenders, weights, device) -> dict:
    """``{contender: None or the reason it cannot run}`` for the learned optimizer's contenders."""
    reasons = {}
    for contender in LEARNED_CONTENDERS:
        if contender not in contenders:
            reasons[contender] = {"naive+compile": NOT_SELECTED_COMPILE, "fused-fast": NOT_SELECTED_FAST}.get(
                contender, "not selected (--backends)")
        elif contender in FUSED_CONTENDERS:
            reasons[contender] = fused_unavailable_reason(optimizer_name, weights, device, contender)
        else:
            reasons[contender] = None
    return reasons


@contextlib.contextmanager
def quiet_graph_breaks():
    """Silence dynamo's graph-break warnings while compiled contenders run (restored afterwards).

    lopt's naive step under ``nonfinite="raise"`` breaks the graph by design: it reads on the host
    whether every gradient is finite before it changes anything (under the default ``"skip"`` it
    decides on the device, without a break).
    """
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
