"""lopt.meta's population-batched optimizers against the real ones, member by member."""

import warnings

import pytest
import torch

import lopt
from lopt.meta import batched
from lopt.meta.metaparams import MetaParamSpace

SHAPES = [(5,), (4, 6), (6, 4), (5, 5), (2, 3, 4), (), (1, 7), (8, 3, 3, 3), (1,)]


def _relative(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.usefixtures("single_intra_op_thread")
def test_one_member_of_the_batched_step_is_smallfclopt():
    """Every member, with its own meta-weights, steps exactly as SmallFCLOpt(backend="naive") with those
    weights: 6 steps, every rank, a member that skips a step on a NaN gradient (its step count lags)."""
    population, steps = 3, 6
    space = MetaParamSpace("small_fc_lopt")
    thetas = torch.stack([space.flatten(lopt.random_weights("small_fc_lopt", seed=s)) for s in range(population)])
    generator = torch.Generator().manual_seed(0)
    init = [torch.randn((population,) + s, generator=generator) for s in SHAPES]
    grads = [[torch.randn((population,) + s, generator=generator) * 10.0 ** (i % 3 - 1) for i, s in enumerate(SHAPES)]
             for _ in range(steps)]
    grads[2][1][1, 0, 0] = float("nan")  # member 1 skips step 3 (all its tensors)

    opt = batched.BatchedSmallFCLOpt(SHAPES, population)
    state = opt.init_state()
    params = [p.clone() for p in init]
    network = space.unflatten(thetas)
    history = []
    for t in range(steps):
        params = opt.step(params, grads[t], state, network)
        history.append([p.clone() for p in params])
    assert state["step"].tolist() == [steps, steps - 1, steps]

    for m in range(population):
        reference = [torch.nn.Parameter(p[m].clone()) for p in init]
        weights = space.to_meta_weights(thetas[m])
        opt_m = lopt.SmallFCLOpt(reference, weights=weights, backend="naive")
        previous = [p.detach().clone() for p in reference]
        for t in range(steps):
            for p, g in zip(reference, grads[t]):
                p.grad = g[m].clone()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt_m.step()
            for i, p in enumerate(reference):
                got = history[t][i][m]
                update_ref = p.detach() - previous[i]
                update_got = got - previous[i]
                if update_ref.norm() == 0:
                    assert torch.equal(got, p.detach())
                else:
                    assert _relative(update_got, update_ref) <= 1e-6, (m, t, SHAPES[i])
                assert _relative(got, p.detach()) <= 1e-6
            previous = [p.detach().clone() for p in reference]
            # the state too (one example buffer per tensor)
        for i, p in enumerate(reference):
            ref_state = opt_m.state[p]
            for name in ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v"):
                if ref_state[name].numel():
                    got = state["tensors"][i][name][m].reshape(ref_state[name].shape)
                    assert _relative(got, ref_state[name]) <= 1e-6, (name, SHAPES[i])


@pytest.mark.usefixtures("single_intra_op_thread")
def test_shared_network_equals_batched_copies():
    """One network shared by every member (meta-eval) gives what per-member copies of it give."""
    population = 4
    space = MetaParamSpace("small_fc_lopt")
    theta = space.flatten(lopt.random_weights("small_fc_lopt", seed=3))
    shapes = [(7, 5), (7,)]
    generator = torch.Generator().manual_seed(1)
    params = [torch.randn((population,) + s, generator=generator) for s in shapes]
    grads = [torch.randn((population,) + s, generator=generator) for s in shapes]
    opt = batched.BatchedSmallFCLOpt(shapes, population)
    shared = opt.step(params, grads, opt.init_state(), space.unflatten(theta))
    copies = opt.step(params, grads, opt.init_state(), space.unflatten(theta.expand(population, -1)))
    for a, b, p in zip(shared, copies, params):
        assert _relative(a - p, b - p) <= 1e-6


def test_batched_adamw_is_torch_adamw():
    population, shapes = 3, [(4, 3), (3,)]
    generator = torch.Generator().manual_seed(2)
    init = [torch.randn((population,) + s, generator=generator) for s in shapes]
    grads = [[torch.randn((population,) + s, generator=generator) for s in shapes] for _ in range(5)]
    lrs = torch.tensor([1e-3, 3e-2, 1e-1])
    opt = batched.BatchedAdamW(shapes, population, lr=lrs, weight_decay=0.01)
    state = opt.init_state()
    params = [p.clone() for p in init]
    for g in grads:
        params = opt.step(params, g, state)
    for m in range(population):
        reference = [torch.nn.Parameter(p[m].clone()) for p in init]
        torch_opt = torch.optim.AdamW(reference, lr=float(lrs[m]), weight_decay=0.01, foreach=False)
        for g in grads:
            for p, gi in zip(reference, g):
                p.grad = gi[m].clone()
            torch_opt.step()
        for p, got in zip(reference, params):
            assert _relative(got[m], p.detach()) <= 1e-6
