"""What the CUDA tests of both fused optimizers share: inputs, error measures, launch counting."""

from __future__ import annotations

import torch

from lopt import registry

# Every rank, tiny tensors and ones that fill many blocks; size-1 axes; ties between axis sizes; factored
# tensors whose last axis is a multiple of 32 (small_fc_lopt's exact apply pass takes their warps' shared
# slow entries as one vector: R's or C's, with a partial last chunk, with an outer axis); tensors of rank >= 3
# whose leading axes are all of size 1 (one slice of the last two axes: CELO2's fused passes step them as matrices).
SHAPES = [(), (1,), (37,), (4, 6), (6, 4), (5, 5), (1, 7), (7, 1), (300, 129), (2, 3, 4), (8, 3, 3, 3), (16, 16, 3, 3),
          (3, 1, 5, 1), (2, 5, 1, 3, 4), (1000, 3), (64, 64, 3, 3), (96, 64), (64, 96), (37, 64), (3, 40, 64),
          (1, 9, 7), (24, 16, 1, 1)]
LARGE_SHAPES = [(70001,), (300, 260), (1, 70000), (64, 32, 36), (16, 16, 17, 17), (4, 4, 4, 33, 33),
                (1, 1, 260, 300)]
ALL_SHAPES = SHAPES + LARGE_SHAPES
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_params(shapes, dtype=torch.float32, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device=device, dtype=dtype)) for s in shapes]


def random_grads(params, seed, scale=1e-2):
    """A different gradient scale per tensor, all drawn from one seeded generator (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=g) * scale * (1 + torch.rand((), generator=g).item())).to(p.device, p.dtype)
            for p in params]


def set_grads(params, grads):
    for p, grad in zip(params, grads):
        p.grad = grad.clone()  # a fresh tensor every step, as autograd makes them


def relative_error(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# Tensors of fewer elements are judged against the step's update scale, not their own update
# (tensor_update_error).
TINY_TENSOR_NUMEL = 64


def update_scale(updates) -> float:
    """The root-mean-square update of a step's elements (its tensors' updates together)."""
    everything = flat(updates)
    return float(everything.norm() / max(everything.numel(), 1) ** 0.5)


def tensor_update_error(fused_update, naive_update, step_scale: float) -> float:
    """How far one tensor's fused update is from the naive one, for the float32 bounds: relative to its
    own update (relative_error) for tensors of TINY_TENSOR_NUMEL elements or more; for fewer, relative
    to the larger of its own update and the step's scale for its elements (``step_scale``:
    update_scale, the root-mean-square update per element). A tensor of a handful of elements has an
    update of a few MLP outputs, and where the output layer cancels, that update is near zero: float32
    rounding in either backend then moves it by up to 1e-3 of itself (the exact mode's TF32 and FP16
    builds alike: docs/performance.md), a difference far below the step's scale."""
    if fused_update.numel() >= TINY_TENSOR_NUMEL:
        return relative_error(fused_update, naive_update)
    fused, naive = fused_update.double(), naive_update.double()
    yardstick = max(float(naive.norm()), step_scale * max(naive.numel(), 1) ** 0.5, 1e-30)
    return float((fused - naive).norm()) / yardstick


def flat(tensors):
    return torch.cat([t.reshape(-1).double() for t in tensors])


def step(opt, loss=1.0):
    return opt.step(loss) if opt.requires_loss else opt.step()


def sync_into(dst_opt, dst_params, src_opt, src_params):
    """Give dst exactly src's parameters, state and step counts."""
    for d, s in zip(dst_params, src_params):
        d.data.copy_(s.data)
    dst_opt.load_state_dict(src_opt.state_dict())


def step_twins(fused, fused_params, naive, naive_params, grads, loss=None) -> list:
    """One step of each twin on the same gradients; returns the parameters before it (float32 copies)."""
    set_grads(fused_params, grads)
    set_grads(naive_params, grads)
    before = [p.detach().float().clone() for p in fused_params]
    step(fused, loss)
    step(naive, loss)
    return before


def scaled_twin_step_error(fused, fused_params, naive, naive_params, grads, scaler=None) -> float:
    """One step of each twin from the same state, the fused one through ``scaler`` (GradScaler: scaled
    gradients, ``scaler.step``) where given: the relative error of the fused update against the naive one."""
    set_grads(fused_params, [g * scaler.get_scale() for g in grads] if scaler is not None else grads)
    set_grads(naive_params, grads)
    before = [p.detach().clone() for p in fused_params]
    if scaler is not None:
        scaler.step(fused)
        scaler.update()
    else:
        fused.step()
    naive.step()
    return relative_error(flat([f.detach() - b for f, b in zip(fused_params, before)]),
                          flat([n.detach() - b for n, b in zip(naive_params, before)]))


def kernel_launches(fn) -> int:
    """Kernels (not copies) the CUDA runtime saw while ``fn`` ran (torch.profiler, CUPTI: CuPy's launches too)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


# The relative error of one tensor's float32 update allowed against another float32 computation of it or the
# float64 definition: the brief's 1e-5, except where CELO2 orthogonalises a tensor of rank >= 4 slice by slice.
# Newton-Schulz is ill-conditioned in float32 for matrices with a tiny singular value: rounding errors (of the
# MLP's output and of the iteration's products) along it grow by up to p'(0)^5 = 3.4445^5 ~ 486 while the step
# stays of unit size (docs/celo2.md §3.6). A conv kernel's 3 x 3 slices include nearly singular ones (singular
# values 1 : 0.14 : 0.0013): the naive step measured up to 2.0e-5 from float64 (2-d and 3-d tensors: 5.3e-6), and
# the fused celo2_slices (its own float32 sums, in index order) up to 2.5e-5 from the naive one.
UPDATE_RTOL = 1e-5
NEWTON_SCHULZ_SLICES_RTOL = 4e-5


def update_rtol(name: str, shape, orthogonalize: bool = True) -> float:
    """The float32 bound on one tensor's relative update error for optimizer ``name`` (UPDATE_RTOL; see there)."""
    sliced = name in ("celo2", "elo_celo2") and orthogonalize and len(shape) >= 4
    return NEWTON_SCHULZ_SLICES_RTOL if sliced else UPDATE_RTOL


def low_precision_excess(fused: torch.Tensor, naive: torch.Tensor, before: torch.Tensor,
                          rtol: float = UPDATE_RTOL) -> torch.Tensor:
    """How far a bfloat16/float16 fused result is from the naive one beyond what the same float32 math
    rounded once can explain: one ulp of the result plus ``rtol`` of the tensor's largest update (the
    float32 tolerance; where p − lr·u cancels, a tiny difference of u is many ulps of the small
    result; ``rtol``: update_rtol). <= 0 where they agree."""
    f32, n32 = fused.detach().float(), naive.detach().float()
    info = torch.finfo(fused.dtype)
    one_ulp = info.eps * n32.abs().clamp_min(info.tiny)
    return (f32 - n32).abs() - (one_ulp + rtol * (n32 - before).abs().max())


def make_optimizer(name, params, backend, weights, **kwargs):
    """The registered optimizer ``name`` (with its required arguments, e.g. VeLO's num_steps, where not given)."""
    return registry.get(name).build(params, weights=weights, backend=backend, **kwargs)


def fused_engine_optimizers() -> list:
    """One registered optimizer per fused engine, the first registered that uses it (small_fc_lopt, velo):
    the fused tests run once per engine (ELO has its own: small_fc_lopt's kernels with its traits; CELO2's covers
    ELO-CELO2, whose own variants run in tests/test_celo2.py). Optimizers without one are naive-only; one that reuses
    another's engine (MuLO: SmallFCLOpt's, on groups of its own) has its fused test in its own module."""
    first = {}
    for name in registry.names():
        engine = registry.get(name).fused
        if engine and engine not in first:
            first[engine] = name
    return list(first.values())
