"""The optimizer registry (lopt/registry.py) against what it names, and the generic properties every
registered optimizer has (parametrised over the registry, so a new entry is tested as soon as it exists)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import lopt
from lopt import registry
from lopt import weights as weights_lib
from lopt.fused import launcher


@pytest.mark.parametrize("name", registry.names())
def test_each_entry_names_what_exists(name):
    entry = registry.get(name)
    cls = entry.front_end_class
    assert issubclass(cls, torch.optim.Optimizer) and getattr(lopt, cls.__name__) is cls
    assert cls.architecture == entry.architecture and cls.reference is entry.reference_module
    assert registry.entry_for(cls) is entry
    assert entry.architecture in weights_lib.architectures()
    assert weights_lib.registered_weights()[entry.default_weights].architecture == entry.architecture
    if entry.fused:
        engine = entry.fused_engine_class
        assert (launcher.cuda_source_dir() / engine.SOURCE).exists()
        assert entry.architecture in registry.fused_architectures()


def test_unknown_names_are_refused_with_the_list():
    with pytest.raises(ValueError, match=r"no optimizer named 'adam'; lopt has small_fc_lopt, velo"):
        registry.get("adam")
    with pytest.raises(ValueError, match="is registered already"):
        registry.register(registry.get("velo"))
    with pytest.raises(ValueError, match="Adam is not a registered lopt optimizer"):
        registry.entry_for(torch.optim.Adam)


def _built(name, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(6, 4), (5,), (3, 2, 2)]]
    opt = registry.get(name).build(params, backend="naive",
                                   weights=lopt.random_weights(registry.get(name).architecture, seed=1))
    return opt, params


def _step(opt, params, seed):
    g = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step(torch.tensor(2.0 - 0.1 * seed)) if opt.requires_loss else opt.step()


@pytest.mark.parametrize("name", registry.names())
def test_state_dict_resume_and_copies_are_exact(name):
    """Three steps straight equal two steps, a save, a new optimizer loading it (and a deepcopy and a pickle
    of the first) and a third step: bit for bit, for every registered optimizer."""
    straight, p_straight = _built(name)
    for s in range(3):
        _step(straight, p_straight, s)
    resumed, p_resumed = _built(name)
    for s in range(2):
        _step(resumed, p_resumed, s)
    saved = copy.deepcopy(resumed.state_dict())
    twin, p_twin = _built(name)
    with torch.no_grad():
        for a, b in zip(p_twin, p_resumed):
            a.copy_(b)
    twin.load_state_dict(saved)
    pickled = pickle.loads(pickle.dumps((resumed, p_resumed)))
    _step(resumed, p_resumed, 2)
    _step(twin, p_twin, 2)
    _step(pickled[0], pickled[1], 2)
    for a, b, c, d in zip(p_straight, p_resumed, p_twin, pickled[1]):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("name, other", [(a, b) for a in registry.names() for b in registry.names() if a != b])
def test_another_registered_optimizers_state_is_refused_by_name(name, other):
    target, params = _built(name)
    source, source_params = _built(other)
    _step(source, source_params, 0)
    before = copy.deepcopy(target.state_dict())
    cls = registry.get(other).front_end_class
    with pytest.raises(ValueError, match=rf"state dict of lopt\.{cls.__name__}, not of .*nothing was changed"):
        target.load_state_dict(source.state_dict())
    assert _same(target.state_dict(), before)
