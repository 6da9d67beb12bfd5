"""Recipe: timm's create_optimizer_v2 with lopt's optimizers (docs/integrations.md).

timm imports torchvision at import time, and PyPI's torchvision cannot load beside the CPU build of
torch that CI uses ("operator torchvision::nms does not exist"): there the tests against the real
timm skip with that reason, and the name handling and the error are tested without it. On the GPU
machine (timm and torchvision installed): ``python3 -m pytest -q tests/test_integrations_timm.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lopt
from lopt import registry
from integrations_support import CELO2_WEIGHTS, SMALL_FC_WEIGHTS, VELO_WEIGHTS, make_net
from lopt.integrations.timm import register_timm_optimizer, register_timm_optimizers, timm_lookup_key, timm_names


def _import_timm_optim():
    try:
        import timm.optim

        return timm.optim, None
    except ModuleNotFoundError as err:
        return None, (f"{err}; the test extra leaves timm out because it brings torchvision, and PyPI's torchvision "
                      f"cannot load beside the CPU build of torch (operator torchvision::nms does not exist)")
    except Exception as err:  # e.g. torchvision's RuntimeError for a build made for another torch
        return None, f"{type(err).__name__}: {err}"


timm_optim, TIMM_IMPORT_ERROR = _import_timm_optim()
needs_timm = pytest.mark.skipif(timm_optim is None, reason=f"timm cannot be imported here ({TIMM_IMPORT_ERROR})")


@pytest.mark.parametrize("name, key", [("small_fc_lopt", "lopt"), ("velo", "velo"), ("Small_FC_LOpt", "lopt"),
                                       ("myvelo", "myvelo")])
def test_lookup_key_is_the_part_timm_looks_up(name, key):
    assert timm_lookup_key(name) == key


@pytest.mark.parametrize("name, message", [
    ("", "non-empty string"), ("_", "non-empty string"), (None, "non-empty string"),
    ("small__lopt", "empty part"), ("velo_", "empty part"),
    ("lookahead_velo", "reads as 'wrap in Lookahead'")])
def test_names_timm_cannot_resolve_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        timm_lookup_key(name)


@pytest.mark.skipif(timm_optim is not None, reason="timm imports here")
def test_without_a_working_timm_registration_says_why():
    with pytest.raises(ImportError, match="needs a working timm"):
        register_timm_optimizers()


@needs_timm
def test_create_optimizer_v2_builds_small_fc_lopt_with_timm_weight_decay_groups():
    assert register_timm_optimizers() == timm_names()
    assert register_timm_optimizers() == timm_names()  # idempotent
    assert {"small_fc_lopt", "lopt", "velo", "celo2", "elocelo2", "elo", "mulo"} <= set(timm_optim.list_optimizers())

    model = make_net(seed=1)
    opt = timm_optim.create_optimizer_v2(model, "small_fc_lopt", weight_decay=0.05, weights=SMALL_FC_WEIGHTS,
                                         backend="naive")
    assert type(opt) is lopt.SmallFCLOpt
    decays = {id(p): group["weight_decay"] for group in opt.param_groups for p in group["params"]}
    assert decays == {id(p): (0.05 if p.dim() > 1 else 0.0) for p in model.parameters()}
    assert all(group["lr"] == 1.0 for group in opt.param_groups)

    # It steps as the same optimizer built by hand with the same groups.
    twin = make_net(seed=1)
    twin_opt = lopt.SmallFCLOpt([{"params": [p for p in twin.parameters() if p.dim() <= 1], "weight_decay": 0.0},
                                 {"params": [p for p in twin.parameters() if p.dim() > 1], "weight_decay": 0.05}],
                                weights=SMALL_FC_WEIGHTS, backend="naive")
    x = torch.randn(8, 5)
    for net, optimizer in ((model, opt), (twin, twin_opt)):
        net(x).square().mean().backward()
        optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_every_registered_optimizer_has_a_timm_name_of_its_own():
    # timm resolves a name by its last '_' part: 'elo_celo2' would be CELO2, so ELO-CELO2 is 'elocelo2'.
    names = timm_names()
    assert names == [registry.get(name).timm_registration_name for name in registry.names()]
    assert names[registry.names().index("elo_celo2")] == "elocelo2"
    keys = [timm_lookup_key(name) for name in names]
    assert len(set(keys)) == len(keys)
    assert dict(zip(registry.names(), keys))["celo2"] == "celo2"


def test_two_optimizers_that_timm_would_confuse_are_refused(monkeypatch):
    clash = dataclasses.replace(registry.get("celo2"), name="elo_celo2_copy", timm_name="my_celo2")
    monkeypatch.setitem(registry.OPTIMIZERS, clash.name, clash)
    with pytest.raises(ValueError, match=r"'celo2' and 'my_celo2'.*both looks up as 'celo2'.*timm_name"):
        timm_names()


@needs_timm
def test_create_optimizer_v2_builds_celo2_and_elo_celo2_by_their_timm_names():
    register_timm_optimizers()
    model = make_net(seed=1)
    assert type(timm_optim.create_optimizer_v2(model, "celo2", weights=CELO2_WEIGHTS, backend="naive")) is lopt.CELO2
    assert type(timm_optim.create_optimizer_v2(model, "elocelo2", weights=CELO2_WEIGHTS, backend="naive")) is lopt.ELO_CELO2


@needs_timm
def test_create_optimizer_v2_builds_velo_and_lookahead_variants():
    register_timm_optimizers()
    model = make_net(seed=1)
    velo = timm_optim.create_optimizer_v2(model, "velo", num_steps=100, weights=VELO_WEIGHTS, backend="naive")
    assert type(velo) is lopt.VeLO and velo.num_steps == 100
    wrapped = timm_optim.create_optimizer_v2(model, "lookahead_small_fc_lopt", weights=SMALL_FC_WEIGHTS,
                                             backend="naive")
    assert isinstance(wrapped, timm_optim.Lookahead)
    base = getattr(wrapped, "_base_optimizer", None) or wrapped.base_optimizer  # (renamed across timm versions)
    assert type(base) is lopt.SmallFCLOpt
    with pytest.raises(TypeError, match="num_steps"):
        timm_optim.create_optimizer_v2(model, "velo", weights=VELO_WEIGHTS)


@needs_timm
def test_a_name_whose_last_part_is_taken_is_refused_and_nothing_changes():
    register_timm_optimizers()
    before = timm_optim.list_optimizers()
    with pytest.raises(ValueError, match=r"last '_' part \('lopt'\).*'small_fc_lopt'"):
        register_timm_optimizer("other_lopt", lopt.VeLO)
    with pytest.raises(ValueError, match=r"'adamw' is already 'adamw'"):
        register_timm_optimizer("fancy_adamw", lopt.SmallFCLOpt)
    assert timm_optim.list_optimizers() == before


@needs_timm
def test_a_custom_name_with_defaults_in_a_registry_of_ones_own():
    registry = timm_optim.OptimizerRegistry()
    assert register_timm_optimizer("my_velo_long", lopt.VeLO, defaults={"num_steps": 7}, registry=registry) == "long"
    assert registry.list_optimizers() == ["long", "my_velo_long"]
    velo = registry.create_optimizer(make_net(seed=1), "my_velo_long", weights=VELO_WEIGHTS, backend="naive")
    assert type(velo) is lopt.VeLO and velo.num_steps == 7
