"""CELO2 and ELO-CELO2 (docs/celo2.md): lopt's float32 reference and front-ends against the independent
float64 oracle (tests/spec_celo2.py), and what the front-ends do around the math (validation, state,
routing, the non-finite policy, weights).

Whole steps are "teacher forced": the oracle starts each step from lopt's own float32 state and
parameters, so the tolerance measures one step's rounding, not drift.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import warnings

import pytest
import torch

import lopt
import spec_celo2 as spec
from fused_helpers import update_rtol
from lopt.reference import accumulators as acc
from lopt.reference import celo2 as ref

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

WEIGHTS = lopt.random_weights("celo2", seed=5)
NET = WEIGHTS.tensors["mlp"]

SHAPES = {
    "wide": (4, 6), "tall": (6, 4), "square": (5, 5), "row": (1, 7), "column": (7, 1), "large_wide": (16, 48),
    "large_tall": (40, 12), "3d": (2, 3, 4), "conv": (8, 3, 3, 3), "conv_tie": (4, 4, 3, 3), "conv1x1": (6, 4, 1, 1), "bias": (7,),
    "scalar": (), "token": (1, 1, 9), "one_slice": (1, 6, 4),  # (one slice: the fused passes step them as matrices)
    # slices of more than 32 elements (the fused celo2_slices gives each a warp: its lanes take two elements each),
    # a 7 x 7 conv kernel's and a 3-d tensor's tall 8 x 5 slices (iterated as their transpose)
    "conv7x7": (3, 2, 7, 7), "tall_slices": (2, 8, 5),
}
EMBEDDING = (10, 4)


def rel_err(got, want) -> float:
    got = got.detach().to(torch.float64)
    want = want.detach().to(torch.float64)
    scale = want.abs().max().item()
    assert scale > 0, "reference value is all zeros: the test would prove nothing"
    return (got - want).abs().max().item() / scale


def random_like(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32) * scale


# ------------------------------------------------------------------------------------------ reference, stage by stage


def test_decays_are_the_given_numbers_in_float32():
    decays = ref.Decays.from_offsets()
    assert decays.momentum.tolist() == list(spec.BETA_M)
    assert decays.rms.tolist() == [spec.BETA_V]
    assert decays.adafactor.tolist() == list(spec.BETA_F)
    assert ref.Decays.from_offsets((0.5, 0.6, 0.7), (0.8,), (0.1, 0.2, 0.3)).rms.tolist() == [spec.f32(0.8)]


@pytest.mark.parametrize("shape", [(5, 5), (4, 4, 4), (4, 4, 3, 3), (2, 2, 1, 1), (768, 3, 16, 16), (3, 7), (7,), ()])
def test_factored_axes_follow_the_stable_tie_rule(shape):
    assert ref.factored_dims(shape) == spec.factored_axes(shape)


@pytest.mark.parametrize("shape", [(4, 6), (6, 4), (5, 5), (1, 7), (7, 1), (1, 1), (48, 16), (3, 8, 8), (2, 3, 3, 3)])
def test_newton_schulz_matches_float64(shape):
    x = random_like(shape, 1)
    assert rel_err(ref.newton_schulz(x), spec.newton_schulz(x)) < 2e-6


@pytest.mark.parametrize("shape", [(7, 5, 5), (4, 16, 48), (3, 48, 16), (5, 3, 3), (6, 1, 9)])
def test_newton_schulz_of_a_stack_is_the_stack_of_the_results(shape):
    """What a batched (torch.bmm) fused version relies on: the function of a stack is the function of each
    matrix (the same arithmetic; bitwise wherever the BLAS takes the same path for both)."""
    x = random_like(shape, 2)
    one_by_one = torch.stack([ref.newton_schulz(m) for m in x])
    assert (ref.newton_schulz(x) - one_by_one).abs().max().item() <= 4e-6 * one_by_one.abs().max().item()


def test_newton_schulz_transposes_tall_matrices_and_orthogonalises():
    x = random_like((40, 12), 3)
    y = ref.newton_schulz(x)
    torch.testing.assert_close(ref.newton_schulz(x.T.contiguous()), y.T, rtol=0, atol=1e-6)
    singular = torch.linalg.svdvals(y.double())
    assert 0.6 < singular.min() and singular.max() < 1.25  # Muon's quintic: roughly, not exactly, orthogonal


@pytest.mark.parametrize("shape", [(9, 7), (9,), (9, 3, 3, 3)])
def test_the_sums_of_row_blocks_complete_the_whole_tensors(shape):
    """What FSDP2's row shards rely on (the phases of lopt/optimizers/celo2.py): the sums over the last two axes
    of a vector's or a matrix's row blocks add up to the whole tensor's (split axis 0 is one of the two), a
    higher-rank tensor's rows carry complete sums of their own, and Newton-Schulz of the matrix gathered from
    its rows (placed in zeros and summed) is the whole matrix's."""
    x = random_like(shape + (5,), 6)
    whole = ref.last_axes_square_sums(x)
    blocks = [ref.last_axes_square_sums(x[a:b]) for a, b in ((0, 4), (4, 4), (4, 9))]
    if len(shape) <= 2:
        torch.testing.assert_close(sum(blocks), whole, rtol=1e-12, atol=0)
    else:
        assert torch.equal(torch.cat(blocks), whole)
    if len(shape) == 2:
        step = x[..., 0]
        gathered = sum(torch.zeros(shape).index_copy(0, torch.arange(a, b), step[a:b]).double()
                       for a, b in ((0, 4), (4, 4), (4, 9)))
        assert torch.equal(ref.newton_schulz(gathered.float())[4:9], ref.newton_schulz(step)[4:9])


def _state_after(shape, grads, decays):
    """lopt's float32 accumulators after ``grads`` (0-d as a 1-element vector) and the oracle's."""
    work = spec.work_shape(shape)
    dims = ref.factored_dims(work if shape else ())
    state = acc.init_state(work, dims)
    oracle = spec.new_state(shape)
    for g in grads:
        acc.update_accumulators(state, g.reshape(work + (1,)), decays, dims)
        spec.accumulate(oracle, g)
    return state, dims, oracle


@pytest.mark.parametrize("name", list(SHAPES) + ["embedding"])
def test_features_match_the_oracle(name):
    shape = SHAPES.get(name, EMBEDDING)
    grads = [random_like(shape, 10 + s) for s in range(3)]
    p = random_like(shape, 20)
    state, dims, oracle = _state_after(shape, grads, ref.Decays.from_offsets())
    work = spec.work_shape(shape)
    got = ref.per_element_features(grads[-1].reshape(work + (1,)), p.reshape(work + (1,)), state, dims)
    want = torch.cat(spec.features(grads[-1], p, oracle), dim=-1)
    assert got.shape[-1] == (ref.NUM_INPUTS if len(shape) >= 2 else ref.UNFACTORED_INPUTS) == want.shape[-1]
    for j in range(want.shape[-1]):
        assert rel_err(got[..., j], want[..., j]) < 1e-6, j
    normalised = ref.normalise_over_last_axes(got)
    want_normalised = spec.normalise(want, len(work))
    for j in range(want.shape[-1]):
        assert rel_err(normalised[..., j], want_normalised[..., j]) < 2e-6, j


def test_the_split_first_layer_is_the_sum_over_groups():
    x = random_like((5, 7, ref.NUM_INPUTS), 4)
    groups = torch.split(x.double(), ref.GROUP_WIDTHS, dim=-1)
    for inputs, pieces in ((x, groups), (x[..., :ref.UNFACTORED_INPUTS], groups[:ref.UNFACTORED_GROUPS])):
        direction, magnitude = ref.mlp(inputs, NET)
        want_direction, want_magnitude = spec.mlp(list(pieces), NET)
        assert rel_err(direction, want_direction) < 1e-6 and rel_err(magnitude, want_magnitude) < 1e-6


@pytest.mark.parametrize("options", [{}, {"orthogonalize": False, "param_scale_mult": True, "exp_mult": 0.3,
                                          "rms_mult": 0.7, "weight_decay": 0.2}])
@pytest.mark.parametrize("name", list(SHAPES))
def test_learned_step_function_matches_the_oracle(name, options):
    """lopt.reference.celo2.learned_step (one tensor, the readable form) against the oracle, three steps."""
    shape = SHAPES[name]
    options = {"weight_decay": 0.1, **options}
    p = torch.nn.Parameter(random_like(shape, 30))
    state = acc.init_state(shape, ref.factored_dims(shape))
    decays = ref.Decays.from_offsets()
    for s in range(3):
        g = random_like(shape, 40 + s)
        oracle = spec.from_lopt_state(state, shape)
        want = spec.learned_step(p.detach(), g, oracle, NET, lr=1.0, **options)
        before = p.detach().clone()
        with torch.no_grad():
            ref.learned_step(p, g, state, NET, decays, lr=1.0, **options)
        assert rel_err(p.detach() - before, want["p"] - before.double()) < update_rtol("celo2", shape, options.get("orthogonalize", True)), s


# ------------------------------------------------------------------------------------------ the optimizers, whole steps

VARIANTS = {
    "celo2": (lopt.CELO2, {"weight_decay": 0.1}, 1.0),
    "celo2_global_clip": (lopt.CELO2, {"max_grad_norm": 1.0, "adam_betas": (0.8, 0.9), "adam_eps": 1e-6}, 10.0),
    "celo2_element_clamp": (lopt.CELO2, {"grad_clip_value": 2.0}, 1.5),
    "celo2_base": (lopt.CELO2, {"orthogonalize": False, "param_scale_mult": True, "exp_mult": 0.5, "rms_mult": 0.7,
                                "adam_lr_mult": 2.0, "adam_weight_decay": 0.05}, 1.0),
    "celo2_all_learned": (lopt.CELO2, {"use_adamw_for_1d": False, "weight_decay": 0.1}, 1.0),
    "elo_celo2": (lopt.ELO_CELO2, {}, 1.0),
    "elo_celo2_unclipped": (lopt.ELO_CELO2, {"max_grad_norm": None, "adam_lr_mult": 0.5}, 1.0),
}


def _build(variant, dtype=torch.float32, backend="naive", device="cpu", weights=None):
    cls, options, grad_scale = VARIANTS[variant]
    main = [torch.nn.Parameter(random_like(shape, 50 + i).to(device, dtype)) for i, shape in enumerate(SHAPES.values())]
    embedding = torch.nn.Parameter(random_like(EMBEDDING, 49).to(device, dtype))
    opt = cls([{"params": main}, {"params": [embedding], "is_embedding": True}], lr=1.0, weights=weights or WEIGHTS,
              backend=backend, **options)
    return opt, main + [embedding], options, grad_scale


def _oracle_step(opt, params, grads, before_params, before_state, options, own_moments):
    """The oracle's new values of every parameter after one step from lopt's state before it."""
    group_of = {id(p): group for group in opt.param_groups for p in group["params"]}
    clipped = spec.clip_all(grads, options.get("max_grad_norm", None if own_moments else 1.0),
                            options.get("grad_clip_value", 1000.0))
    new = []
    for p, g, value in zip(params, clipped, before_params):
        group = group_of[id(p)]
        adamw = group["use_adamw_for_1d"] and (p.dim() <= 1 or group["is_embedding"])
        saved = before_state.get(p) or {}
        if adamw and own_moments:
            adam = spec.from_lopt_state(saved, p.shape) if saved else {"mu": torch.zeros(p.shape, dtype=torch.float64),
                                                                       "nu": torch.zeros(p.shape, dtype=torch.float64),
                                                                       "t": 0}
            new.append(spec.adamw_own(value, g, adam, lr=group["adam_lr_mult"] * group["lr"],
                                      weight_decay=group["adam_weight_decay"], betas=group["adam_betas"],
                                      eps=group["adam_eps"]))
            continue
        oracle = spec.from_lopt_state(saved, p.shape) if saved else spec.new_state(p.shape)
        if adamw:
            new.append(spec.adamw_shared(value, g, oracle, int(group["step"]), lr=group["adam_lr_mult"] * group["lr"],
                                         weight_decay=group["adam_weight_decay"]))
            continue
        new.append(spec.learned_step(value, g, oracle, NET, lr=group["lr"], weight_decay=group["weight_decay"],
                                     exp_mult=group["exp_mult"], rms_mult=group["rms_mult"],
                                     param_scale_mult=group["param_scale_mult"],
                                     orthogonalize=group["orthogonalize"])["p"])
    return new


def nudged_weights(seed: int = 7):
    """WEIGHTS with every meta-weight moved by about 1e-7 of itself: the rounding yardstick's input."""
    g = torch.Generator().manual_seed(seed)
    network = {k: v * (1 + 1e-7 * torch.randn(v.shape, generator=g)) for k, v in NET.items()}
    return dataclasses.replace(WEIGHTS, tensors={**WEIGHTS.tensors, "mlp": network}, source="nudged")


def rounding_yardsticks(variant, state_dict, before_params, grads) -> list:
    """Per tensor, how far the naive backend's own update (CPU, float32) moves when the meta-weights move by
    about 1e-7: the issue's yardstick for where Newton–Schulz amplifies rounding (an ill-conditioned matrix)."""
    updates = []
    for weights in (WEIGHTS, nudged_weights()):
        opt, params, _, _ = _build(variant, weights=weights)
        with torch.no_grad():
            for p, value in zip(params, before_params):
                p.copy_(value)
        opt.load_state_dict(copy.deepcopy(state_dict))
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        updates.append([p.detach() - b for p, b in zip(params, before_params)])
    return [rel_err(a, b.double()) for a, b in zip(*updates)]


def _steps_match_the_oracle(variant, backend="naive", device="cpu"):
    """Matrices of several aspect ratios, a 3-d tensor, conv kernels, a bias, a 0-d parameter and an embedding
    group, four steps: every tensor's update within 1e-5 (relative) of the oracle's, or within the rounding
    yardstick where that is larger (rounding_yardsticks: an ill-conditioned matrix amplifies any rounding, the
    float32 products' own included. The naive backend's products round as the CPU's BLAS kernels do, which
    differ between processors: the 5 x 5 matrix of celo2_element_clamp's third step is 1.2e-5 from the oracle on
    one with AVX-512 FP16, where moving the meta-weights by 1e-7 moves it by 1.6e-5)."""
    opt, params, options, grad_scale = _build(variant, backend=backend, device=device)
    assert opt.backend == backend
    for s in range(4):
        grads = [random_like(p.shape, 100 * s + i, grad_scale) for i, p in enumerate(params)]
        if variant == "celo2_element_clamp":
            grads[0][0, 0] = 5.0  # beyond grad_clip_value=2
        elif variant == "celo2_global_clip":
            grads[0][0, 0] = 2000.0  # beyond the clamp before the global clip, within it after
        for p, g in zip(params, grads):
            p.grad = g.to(device)
        before_params = [p.detach().cpu().clone() for p in params]
        before_state = {p: copy.deepcopy(opt.state[p]) for p in params if p in opt.state}
        yardsticks = rounding_yardsticks(variant, opt.state_dict(), before_params, grads)
        opt.step()
        want = _oracle_step(opt, params, grads, before_params, before_state, options,
                            own_moments=isinstance(opt, lopt.CELO2))
        for name, p, old, new, yardstick in zip(list(SHAPES) + ["embedding"], params, before_params, want, yardsticks):
            bound = max(update_rtol("celo2", p.shape, options.get("orthogonalize", True)), yardstick)
            assert rel_err(p.detach().cpu() - old, new - old.double()) < bound, (s, name, yardstick)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_optimizer_steps_match_the_float64_oracle(variant):
    _steps_match_the_oracle(variant)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_steps_match_the_float64_oracle(variant):
    """The fused backend's acceptance test, written before it (docs/celo2.md §8): the same steps and bounds
    as the naive backend's, on the GPU. It runs once the registry gives CELO2 a fused engine."""
    from lopt import registry
    from lopt.fused import launcher

    assert registry.get("celo2").fused is not None
    if launcher.fused_unavailable_reason("celo2", [torch.device("cuda")]) is not None:
        pytest.skip("needs a CUDA device and CuPy")
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # (the fused engine turns TF32 off for its products itself)
    try:
        _steps_match_the_oracle(variant, backend="fused", device="cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_replayed_newton_schulz_products_are_the_eager_ones_bit_for_bit(precision, monkeypatch):
    """The fused backend captures Newton–Schulz's products once per plan as a CUDA graph and replays it every
    step (CELO2Fused._newton_schulz): the same kernels on the same workspaces as the eager products, so every
    step's parameters and state are the eager backend's bit for bit, also after the coefficients change (a new
    capture)."""
    from lopt.fused import celo2 as fused_celo2
    from lopt.fused import launcher

    if launcher.fused_unavailable_reason("celo2", [torch.device("cuda")]) is not None:
        pytest.skip("needs a CUDA device and CuPy")
    results = []
    for replayed in (True, False):  # (False: the eager path, which a step being captured by its caller takes)
        monkeypatch.setattr(fused_celo2.CELO2Fused, "REPLAY_PRODUCTS", replayed)
        params = [torch.nn.Parameter(random_like(shape, 50 + i).cuda()) for i, shape in enumerate(SHAPES.values())]
        opt = lopt.CELO2(params, lr=0.1, weights=WEIGHTS, backend="fused", precision=precision)
        for s in range(4):
            if s == 2:
                opt.param_groups[0]["ns_coefficients"] = (3.0, -4.0, 1.9)
            for i, p in enumerate(params):
                p.grad = random_like(p.shape, 100 * s + i).cuda()
            opt.step()
        graph = opt._fused_engine.plan.work.products_graph
        assert (graph is not None) is replayed
        results.append([p.detach().clone() for p in params]
                       + [v.clone() for p in params for v in opt.state[p].values() if torch.is_tensor(v)])
        monkeypatch.undo()
    for replayed, eager in zip(*results):
        assert torch.equal(replayed, eager)


@pytest.mark.cuda
def test_global_norm_pass_sums_every_gradient_element_once():
    """celo2_gradient_norm (ELO-CELO2's global clipping): its per-chunk sums add up to the float64 Σ g² of every
    gradient of every group, each element once: quads over whole chunks and a tensor's partial last quad
    (21,007 elements: three chunks), a bfloat16 gradient (quads of 8 bytes, a partial quad), a gradient view
    one element off a quad's alignment (element by element), vectors, the embedding group's (which does not clip
    itself: its gradients count in the norm, and its factor is 1). Its last block's clip factors: the clipping
    group's tensors' max_norm / max(‖g‖, max_norm), ‖g‖ the float32 square root of that sum."""
    from lopt.fused import launcher

    if launcher.fused_unavailable_reason("celo2", [torch.device("cuda")]) is not None:
        pytest.skip("needs a CUDA device and CuPy")
    shapes = [(3001, 7), (40, 9), (5,), (64, 48)]
    params = [torch.nn.Parameter(random_like(shape, 60 + i).cuda()) for i, shape in enumerate(shapes)]
    low = torch.nn.Parameter(random_like((50, 33), 70).cuda().to(torch.bfloat16))
    embedding = torch.nn.Parameter(random_like((30, 8), 71).cuda())
    opt = lopt.ELO_CELO2([{"params": params + [low], "max_grad_norm": 0.7},
                          {"params": [embedding], "is_embedding": True, "max_grad_norm": None}], lr=1e-3,
                         weights=WEIGHTS, backend="fused", precision="fast")
    for step in range(2):  # (the second: the plan's fast check)
        grads = [random_like(p.shape, 80 + 10 * step + i).cuda().to(p.dtype) * 1e-2
                 for i, p in enumerate(params + [low, embedding])]
        storage = torch.full((grads[1].numel() + 1,), float("nan"), device="cuda")
        storage[1:] = grads[1].flatten()
        grads[1] = storage[1:].view(grads[1].shape)  # (4 bytes past a 16-byte boundary)
        for p, g in zip(params + [low, embedding], grads):
            p.grad = g
        opt.step()
        engine = opt._fused_engine
        sums = engine.plan.work.norm_partials[:engine.plan.layout.total_stats_chunks]
        want = sum(g.double().square().sum() for g in grads)
        assert torch.isclose(sums.sum(), want, rtol=1e-6, atol=0), (step, sums.sum().item(), want.item())
        assert (sums > 0).all()
        norm = torch.sqrt(want).float()
        factors = engine.plan.work.transforms[:engine.plan.layout.num_tensors, 0].cpu()
        clipping = torch.tensor([0.7 / max(norm.item(), 0.7)] * 5 + [1.0], dtype=torch.float32)
        assert torch.allclose(factors, clipping, rtol=1e-6, atol=0), (step, factors, clipping)
        assert factors[0] < 1 and int(engine.plan.work.norm_ticket.item()) == 0  # (clipped; the ticket reset)


@pytest.mark.cuda
@pytest.mark.parametrize("cls", [lopt.CELO2, lopt.ELO_CELO2])
def test_each_pass_walks_its_own_tensors_chunks_across_its_grid(cls):
    """The MLP and apply passes walk the learned tensors' chunks, the AdamW pass the AdamW tensors' (CELO2's own
    moments, ELO-CELO2's shared accumulators), each split over its whole grid (accumulators.cuh, walk_chunks_of). Here
    embeddings of ~2,300 chunks
    come first (a walk over every tensor's chunks would number the learned ones after them, as celo2_normalise's
    segment lookup must not), a bfloat16 embedding, a vector with a partial quad, and a parameter and gradient one
    element off a quad's alignment (the element-by-element paths). Three steps of the fused backend against the
    naive one on the GPU: the AdamW tensors' updates within float32 rounding (parameters ~0.02, updates ~0.01: a
    parameter's ulp is ~1e-6 of its update), the bfloat16 parameter within one of its ulps plus float32's
    rounding of its operands (its float32 value a rounding apart can round to either neighbour, and where the
    parameter and its update nearly cancel, a float32 ulp of them is several of the result's bfloat16 ulps: an
    H100 run measured 1.3 of them against the result's ulp alone), the accumulators within 1e-6, and the
    learned matrices' updates within 2e-5 (float32's rounding in two orders of the MLP's sums, through
    Newton–Schulz)."""
    from lopt.fused import launcher

    if launcher.fused_unavailable_reason("celo2", [torch.device("cuda")]) is not None:
        pytest.skip("needs a CUDA device and CuPy")

    def off_by_one(t):  # (a view 4 bytes past a 16-byte boundary)
        storage = torch.full((t.numel() + 1,), float("nan"), device=t.device, dtype=t.dtype)
        storage[1:] = t.flatten()
        return storage[1:].view(t.shape)

    def build(backend):
        embeddings = [torch.nn.Parameter(random_like((3001, 96), 90, 0.02).cuda()),
                      torch.nn.Parameter(random_like((500, 64), 91, 0.02).cuda().to(torch.bfloat16)),
                      torch.nn.Parameter(off_by_one(random_like((77, 20), 92, 0.02).cuda()))]
        learned = [torch.nn.Parameter(random_like(shape, 93 + i, 0.02).cuda())
                   for i, shape in enumerate([(256, 600), (64, 1000), (50003,)])]
        opt = cls([{"params": embeddings, "is_embedding": True}, {"params": learned}], lr=1e-2, weights=WEIGHTS,
                  backend=backend)
        return opt, embeddings + learned

    fused, fused_params = build("fused")
    naive, naive_params = build("naive")
    errors = {}
    for step in range(3):
        for i, (a, b) in enumerate(zip(fused_params, naive_params)):
            g = random_like(a.shape, 300 + 10 * step + i).cuda().to(a.dtype)
            a.grad = off_by_one(g) if i == 2 else g
            b.grad = g.clone()
        before = [p.detach().double() for p in naive_params]
        fused.step()
        naive.step()
        for i, (a, b, old) in enumerate(zip(fused_params, naive_params, before)):
            if a.dtype == torch.bfloat16:  # (one bfloat16 ulp of the new value, plus float32's rounding of the
                # operands: where p and lr·u nearly cancel, a few float32 ulps of them are many bfloat16 ulps of it)
                got, want = a.detach().double(), b.detach().double()
                scale = 2.0 ** -7 * torch.maximum(got.abs(), want.abs()) + 2.0 ** -21 * (old.abs() + (want - old).abs())
                error, bound = float(((got - want).abs() / scale).max()), 1.0
            else:
                error = rel_err(a.detach().double() - old, b.detach().double() - old)
                bound = 2e-5 if i in (3, 4) else 4e-6
            if not error < bound:
                errors[(step, i, "update")] = error
            for key, value in naive.state[b].items():
                if torch.is_tensor(value) and value.is_floating_point() and value.count_nonzero() > 0:
                    error = rel_err(fused.state[a][key], value)
                    if not error < 1e-6:
                        errors[(step, i, key)] = error
    assert not errors, errors
    work = fused._fused_engine.plan.work
    assert (work.learned_walk.rows, work.learned_walk.chunks) == (2, 256 * 600 // 128 + 500)
    assert (work.adamw_walk.rows, work.adamw_walk.chunks) == (4, -(-3001 * 96 // 128) + 250 + -(-77 * 20 // 128)
                                                              + -(-50003 // 128))


# (run in a fresh process: there the fused step's products are the first cuBLAS calls, so the capture meets
# cuBLAS's handle and workspace uncreated, as a training script's first step can)
FIRST_PRODUCTS_SCRIPT = """
import torch, lopt
from lopt.fused import celo2 as fused_celo2
results = []
for replayed in (True, False):
    fused_celo2.CELO2Fused.REPLAY_PRODUCTS = replayed
    params = [torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(i)).cuda())
              for i, shape in enumerate([(64, 96), (96, 64), (1, 1, 32), (7,)])]
    opt = lopt.CELO2(params, lr=0.1, weights=lopt.random_weights("celo2", seed=5), backend="fused",
                     precision="fast")
    for s in range(3):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * s + i)).cuda()
        opt.step()
    assert (opt._fused_engine.plan.work.products_graph is not None) is replayed
    results.append([p.detach().clone() for p in params])
assert all(torch.equal(a, b) for a, b in zip(*results)), "replayed products differ from the eager ones"
print("first products: replayed == eager")
"""


@pytest.mark.cuda
def test_products_captured_where_they_are_the_first_cublas_calls_of_the_process():
    """The capture's warm-up: in a fresh process, the fused step's first Newton–Schulz products (the process's
    first cuBLAS calls) are captured and then replayed, bit for bit the eager products."""
    import subprocess
    import sys

    from lopt.fused import launcher

    if launcher.fused_unavailable_reason("celo2", [torch.device("cuda")]) is not None:
        pytest.skip("needs a CUDA device and CuPy")
    run = subprocess.run([sys.executable, "-c", FIRST_PRODUCTS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "first products: replayed == eager" in run.stdout


def test_the_step_routes_the_parameters_as_the_sources_do():
    opt, params, _, _ = _build("celo2")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    keys = {name: set(opt.state[p]) for name, p in zip(list(SHAPES) + ["embedding"], params)}
    adam = {"exp_avg", "exp_avg_sq", "adam_step"}
    assert keys["bias"] == keys["scalar"] == keys["embedding"] == adam
    assert all(keys[name] == {"mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v"}
               for name in SHAPES if len(SHAPES[name]) >= 2)
    elo, elo_params, _, _ = _build("elo_celo2")
    for p in elo_params:
        p.grad = torch.ones_like(p)
    elo.step()
    assert all(set(elo.state[p]) == {"mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v"} for p in elo_params)
    assert elo.state[elo_params[-1]]["fac_vec_row"].shape == (4, 3)  # the embedding's accumulators, updated (PyLO)
    assert elo.state[elo_params[-1]]["fac_vec_row"].abs().sum() > 0


def test_low_precision_parameters_get_the_float32_step_rounded_once():
    opt32, params32, _, _ = _build("celo2")
    opt16, params16, _, _ = _build("celo2", dtype=torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(params32, params16):
            a.copy_(b.float())
    for a, b in zip(params32, params16):
        b.grad = random_like(a.shape, 7).to(torch.bfloat16)
        a.grad = b.grad.float()
    opt32.step()
    opt16.step()
    for a, b in zip(params32, params16):
        assert torch.equal(a.detach().to(torch.bfloat16), b.detach())
    assert all(v.dtype == (torch.int64 if k == "adam_step" else torch.float32)
               for state in opt16.state.values() for k, v in state.items())


# ------------------------------------------------------------------------------------------ front-end behaviour


def _one(cls=lopt.CELO2, shape=(4, 3), **kwargs):
    p = torch.nn.Parameter(random_like(shape, 1))
    return cls([p], weights=WEIGHTS, **kwargs), p


BAD_ARGUMENTS = [
    ({"lr": -1.0}, ValueError, "Invalid learning rate"),
    ({"weight_decay": math.nan}, ValueError, "weight_decay"),
    ({"adam_lr_mult": -1.0}, ValueError, "adam_lr_mult"),
    ({"adam_weight_decay": -0.1}, ValueError, "adam_weight_decay"),
    ({"adam_betas": (0.9, 1.0)}, ValueError, "Invalid beta parameter at index 1"),
    ({"adam_betas": (0.9,)}, ValueError, "adam_betas must be a pair"),
    ({"adam_eps": -1e-8}, ValueError, "Invalid epsilon value"),
    ({"orthogonalize": 1}, TypeError, "orthogonalize must be True or False"),
    ({"use_adamw_for_1d": "yes"}, TypeError, "use_adamw_for_1d must be True or False"),
    ({"param_scale_mult": None}, TypeError, "param_scale_mult must be True or False"),
    ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
    ({"grad_clip_value": math.inf}, ValueError, "grad_clip_value"),
    ({"exp_mult": math.nan}, ValueError, "exp_mult"),
    ({"rms_mult": math.inf}, ValueError, "rms_mult"),
    ({"momentum_decays": (0.9, 0.99, 1.5)}, ValueError, r"momentum_decays needs 3 decays in \[0, 1\]"),
    ({"rms_decays": (0.9, 0.99)}, ValueError, r"rms_decays needs 1 decays"),
    ({"ns_coefficients": (1.0, 2.0)}, ValueError, "ns_coefficients needs 3 finite numbers"),
    ({"ns_steps": -1}, ValueError, "ns_steps must be an int >= 0"),
    ({"ns_steps": 2.0}, ValueError, "ns_steps must be an int >= 0"),
    ({"ns_eps": 0.0}, ValueError, "ns_eps"),
    ({"precision": "tf32"}, ValueError, r"precision must be one of \('exact', 'fast'\), got 'tf32'"),
    ({"backend": "fused"}, RuntimeError, r"CELO2\(backend='fused'\) cannot run: the parameters are not all on a CUDA "
                                         r"device\. Use backend='naive' or 'auto'"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_ARGUMENTS)
def test_bad_hyperparameters_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        _one(**kwargs)


def test_bad_group_settings_are_refused_before_anything_changes():
    opt, p = _one()
    q = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="param group #1: adam_weight_decay must be a finite number >= 0 in a param"):
        opt.add_param_group({"params": [q], "adam_weight_decay": None})
    with pytest.raises(TypeError, match="is_embedding must be True or False"):
        opt.add_param_group({"params": [q], "is_embedding": "yes"})
    assert len(opt.param_groups) == 1
    elo, _ = _one(lopt.ELO_CELO2)
    with pytest.raises(ValueError, match="ELO_CELO2 takes no adam_betas: its AdamW branch reads the shared"):
        elo.add_param_group({"params": [q], "adam_betas": (0.9, 0.95)})
    with pytest.raises(TypeError, match="adam_eps"):
        lopt.ELO_CELO2([q], weights=WEIGHTS, adam_eps=1e-8)


def test_defaults_backend_and_no_adam_habit_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=lopt.UntrainedWeightsWarning)
        celo2, _ = _one()  # lr=1e-3 is CELO2's own scale: no AdamHabitWarning; auto falls back silently on the CPU
        elo, _ = _one(lopt.ELO_CELO2)
    assert celo2.backend == "naive" and "not all on a CUDA device" in celo2.backend_reason
    group = celo2.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["adam_weight_decay"], group["max_grad_norm"]) == (1e-3, 0.0, 0.0, None)
    assert group["adam_betas"] == (0.9, 0.95) and group["ns_coefficients"] == (3.4445, -4.7750, 2.0315)
    group = elo.param_groups[0]
    assert (group["weight_decay"], group["adam_weight_decay"], group["max_grad_norm"]) == (0.1, 0.1, 1.0)
    assert "adam_betas" not in group and "adam_eps" not in group
    assert lopt.CELO2([torch.nn.Parameter(torch.ones(2, 2))], weight_decay=0.3, adam_weight_decay=None,
                      weights=WEIGHTS).param_groups[0]["adam_weight_decay"] == 0.3


def test_untrained_weights_warn_once_at_the_line_that_built_the_optimizer():
    for cls in (lopt.CELO2, lopt.ELO_CELO2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls([torch.nn.Parameter(torch.ones(2, 2))], weights=lopt.random_weights("celo2"))
        untrained = [w for w in caught if issubclass(w.category, lopt.UntrainedWeightsWarning)]
        assert len(untrained) == 1 and untrained[0].filename == __file__


def test_state_dict_round_trip_and_a_group_that_changes_branch():
    opt, params, _, _ = _build("celo2")
    for s in range(2):
        for i, p in enumerate(params):
            p.grad = random_like(p.shape, s * 10 + i)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][len(params) - 1]["adam_step"] == 2
    pylo_style = copy.deepcopy(saved)
    pylo_style["state"][len(params) - 1]["adam_step"] = 2  # (PyLO saves an int)
    opt.load_state_dict(pylo_style)
    assert opt.state[params[-1]]["adam_step"].dtype == torch.int64 and opt.state[params[-1]]["adam_step"] == 2
    twin, twin_params, _, _ = _build("celo2")
    with torch.no_grad():
        for a, b in zip(twin_params, params):
            a.copy_(b)
    twin.load_state_dict(saved)
    for i, (a, b) in enumerate(zip(params, twin_params)):
        a.grad = random_like(a.shape, 99 + i)
        b.grad = a.grad.clone()
    opt.step()
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))
    # The embedding group switches to the learned branch: its accumulators are created then, its AdamW
    # moments stay in the state (as PyLO keeps them), and the state dict still loads.
    opt.param_groups[1]["is_embedding"] = False
    params[-1].grad = torch.ones(EMBEDDING)
    opt.step()
    assert {"mom", "exp_avg", "adam_step"} <= set(opt.state[params[-1]])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def test_malformed_saved_state_is_refused_and_changes_nothing():
    opt, params, _, _ = _build("celo2")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    embedding_index = len(params) - 1
    for mutate, message in [
        (lambda sd: sd["state"][embedding_index].pop("adam_step"), r"lacks \['adam_step'\]"),
        (lambda sd: sd["state"][embedding_index].update(adam_step=-1),
         f"adam_step of parameter #{embedding_index} must be an int >= 0"),
        (lambda sd: sd["state"][embedding_index].pop("exp_avg_sq"), r"lacks \['exp_avg_sq'\]"),
        (lambda sd: sd["state"][embedding_index].update(exp_avg=torch.zeros(3)), "saved 'exp_avg' has shape"),
        (lambda sd: sd["state"][0].pop("fac_vec_col"), r"lacks \['fac_vec_col'\]"),
        (lambda sd: sd["param_groups"][0].update(ns_steps=-2), "ns_steps must be an int >= 0"),
    ]:
        saved = copy.deepcopy(opt.state_dict())
        mutate(saved)
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(saved)
        after = opt.state_dict()
        assert all(torch.equal(after["state"][i][k], v) for i, values in before["state"].items() for k, v in values.items())


def test_nonfinite_gradients_skip_or_raise_and_change_nothing():
    opt, params, _, _ = _build("celo2")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    params[-1].grad[0, 0] = math.inf  # an AdamW-branch gradient
    with pytest.warns(RuntimeWarning, match=f"step skipped because the gradient of parameter #{len(SHAPES)}"):
        opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(params, before[0]))
    assert opt.param_groups[0]["step"] == 1 and opt.state[params[-1]]["adam_step"] == 1
    opt.nonfinite = "raise"
    params[-1].grad[0, 0] = 1.0
    params[0].grad[1, 1] = math.nan
    with pytest.raises(lopt.NonFiniteGradientError, match="parameter #0"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before[0]))


def test_a_nonfinite_parameter_element_stays_in_its_element():
    """Newton-Schulz mixes a matrix's elements: a NaN parameter element (its features, hence its MLP output,
    are NaN) enters the iteration as 0 and keeps its NaN; every other element steps as if it were absent."""
    opt, p = _one(shape=(6, 5), lr=1.0)
    with torch.no_grad():
        p[2, 3] = math.nan
    p.grad = random_like((6, 5), 8)
    opt.step()
    assert torch.isnan(p[2, 3]) and torch.isfinite(p).sum() == 29


def test_gradient_elements_are_clamped_before_anything_reads_them():
    opt, p = _one(shape=(5, 4), lr=1.0)
    twin, q = _one(shape=(5, 4), lr=1.0)
    p.grad = random_like((5, 4), 3)
    q.grad = p.grad.clone()
    p.grad[1, 2] = 5000.0
    q.grad[1, 2] = 1000.0
    opt.step()
    twin.step()
    assert torch.equal(p, q) and torch.equal(opt.state[p]["mom"], twin.state[q]["mom"])


def test_global_norm_clipping_spans_every_group():
    a = torch.nn.Parameter(torch.zeros(4, 4))
    b = torch.nn.Parameter(torch.zeros(3))
    opt = lopt.ELO_CELO2([{"params": [a]}, {"params": [b], "max_grad_norm": None}], weights=WEIGHTS, lr=1.0,
                         weight_decay=0.0)
    a.grad = torch.full((4, 4), 0.5)  # ‖g‖ over both tensors is 5: group 0 scales by 1/5, group 1 does not clip
    b.grad = torch.full((3,), 7.0 ** 0.5)
    opt.step()
    assert torch.allclose(opt.state[a]["mom"][..., 0], torch.full((4, 4), 0.1 * (1 - spec.BETA_M[0])))
    assert torch.allclose(opt.state[b]["mom"][..., 0], torch.full((3,), 7.0 ** 0.5 * (1 - spec.BETA_M[0])))


def test_tensor_learning_rate_follows_a_scheduler():
    opt, p = _one(lr=torch.tensor(1.0))
    twin, q = _one(lr=1.0)
    for s in range(2):
        p.grad = random_like(p.shape, s)
        q.grad = p.grad.clone()
        opt.step()
        twin.step()
        opt.param_groups[0]["lr"].fill_(0.5)
        twin.param_groups[0]["lr"] = 0.5
    assert torch.equal(p, q)


@pytest.mark.parametrize("backend", ["naive", pytest.param("fused", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("resized, made_for", [(0, r"\(3,\)"), (1, r"\(5, 4\)")])
def test_resized_parameters_are_refused(backend, resized, made_for):
    """A parameter resized (``p.data = ...``) after it stepped, on either branch (its own AdamW moments, the
    learned accumulators), is refused, after steps that made a fused plan, and nothing changes."""
    device = "cuda" if backend == "fused" else "cpu"
    if backend == "fused" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    params = [torch.nn.Parameter(random_like(shape, i).to(device)) for i, shape in enumerate([(3,), (5, 4)])]
    opt = lopt.CELO2(params, weights=WEIGHTS, backend=backend)
    for s in range(2):
        for i, p in enumerate(params):
            p.grad = random_like(p.shape, 10 * s + i).to(device)
        opt.step()
    p = params[resized]
    p.data = random_like((p.shape[0] + 1, *p.shape[1:]), 3).to(device)
    p.grad = random_like(p.shape, 4).to(device)
    before = [q.detach().clone() for q in params]
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises(RuntimeError, match=rf"#{resized} has shape .*made for shape {made_for}.*Nothing was changed"):
        opt.step()
    assert all(torch.equal(q, b) for q, b in zip(params, before))
    after = opt.state_dict()
    assert all(torch.equal(after["state"][k][name], v) if torch.is_tensor(v) else after["state"][k][name] == v
               for k, entry in state["state"].items() for name, v in entry.items())
    assert [g["step"] for g in after["param_groups"]] == [g["step"] for g in state["param_groups"]] == [2]


# ------------------------------------------------------------------------------------------ routing helper


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(11, 6)
        self.pos_embed = torch.nn.Parameter(torch.zeros(5, 6))
        self.block = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.lm_head = torch.nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.wte.weight  # tied


def test_param_groups_for_routes_embeddings_as_the_jax_code_does():
    model = TinyLM()
    groups = lopt.param_groups_for(model, lr=0.5)
    learned, embeddings = groups
    assert [id(p) for p in learned["params"]] == [id(p) for p in (model.block.weight, model.block.bias,
                                                                   model.norm.weight, model.norm.bias)]
    assert embeddings["is_embedding"] is True and embeddings["lr"] == 0.5 == learned["lr"]
    assert [id(p) for p in embeddings["params"]] == [id(model.pos_embed), id(model.wte.weight)]  # (model order)
    named = lopt.param_groups_for(model, named=True, name_patterns=("embed", "block"))
    assert [n for n, _ in named[1]["params"]] == ["pos_embed", "wte.weight", "block.weight", "block.bias"]
    opt = lopt.CELO2(groups, weights=WEIGHTS)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert "exp_avg" in opt.state[model.wte.weight] and "mom" in opt.state[model.block.weight]
    assert "exp_avg" in opt.state[model.block.bias]  # rank 1: AdamW through use_adamw_for_1d
    linear = torch.nn.Linear(3, 3)
    (only,) = lopt.param_groups_for(linear)
    assert set(only) == {"params"} and [id(p) for p in only["params"]] == [id(p) for p in linear.parameters()]


# ------------------------------------------------------------------------------------------ weights


def test_weights_in_pylo_layout_load_and_a_different_network_is_refused(tmp_path):
    WEIGHTS.save(tmp_path / "celo2")
    config = json.loads((tmp_path / "celo2" / "config.json").read_text())
    assert config == {"activation": "relu", "feature_dims": [1, 1, 1, 3, 1, 3, 1, 3, 1, 3, 3, 3, 3, 3],
                      "hidden_layers": 2, "hidden_size": 8, "output_size": 3}
    loaded = lopt.load_weights(tmp_path / "celo2", "celo2")
    assert all(torch.equal(loaded.tensors["mlp"][k], v) for k, v in NET.items())
    opt = lopt.ELO_CELO2([torch.nn.Parameter(torch.ones(2, 2))], weights=str(tmp_path / "celo2"))
    assert opt.meta_weights.pretrained
    (tmp_path / "celo2" / "config.json").write_text(json.dumps({**config, "activation": "tanh"}))
    with pytest.raises(lopt.WeightsError, match="activation='tanh' \\(lopt needs 'relu'\\)"):
        lopt.load_weights(tmp_path / "celo2", "celo2")
    with pytest.raises(lopt.WeightsError, match="describes a different network: hidden_layers=1"):
        lopt.load_weights(lopt.random_weights("small_fc_lopt").save(tmp_path / "sfc")[0], "celo2")
