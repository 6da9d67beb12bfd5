"""Fused small_fc_lopt against the naive backend on the GPU (pytest -m cuda; skipped without CUDA + CuPy)."""

import pytest
import torch

import lopt
from lopt.fused import launcher

pytestmark = pytest.mark.cuda

# Every rank, tiny tensors and ones that fill many blocks.
SHAPES = [(), (1,), (37,), (4, 6), (6, 4), (5, 5), (1, 7), (7, 1), (300, 129), (2, 3, 4), (8, 3, 3, 3), (16, 16, 3, 3),
          (3, 1, 5, 1), (2, 5, 1, 3, 4), (1000, 3)]
TENSOR_CORE_SHAPES = [(70001,), (300, 260), (1, 70000), (64, 32, 36), (16, 16, 17, 17), (4, 4, 4, 33, 33)]
ALL_SHAPES = SHAPES + TENSOR_CORE_SHAPES
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_params(shapes, dtype, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in shapes]


def set_grads(params, seed, scale=1e-2):
    g = torch.Generator().manual_seed(seed)
    for p in params:  # a different gradient scale per tensor, drawn from the same seeded generator
        p.grad = (torch.randn(p.shape, generator=g) * scale * (1 + torch.rand((), generator=g).item())).to(p.device, p.dtype)


def relative_error(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def weights():
    return lopt.random_weights("small_fc_lopt", seed=7)


def sync_into(dst_opt, dst_params, src_opt, src_params):
    """Give dst exactly src's parameters, state and step count."""
    for d, s in zip(dst_params, src_params):
        d.data.copy_(s.data)
    dst_opt.load_state_dict(src_opt.state_dict())


# Per-step relative update error allowed between fused and naive (float32). Tensors of a handful
# of elements get a looser per-tensor bound: their update is one or two MLP outputs, and where the
# output layer cancels (|output| much smaller than its terms), float32 rounding in another
# summation order alone moves it by more than 1e-5 (seen: 2e-5 for a 1-element tensor, even with
# the MLP in plain float32 on the CUDA cores). The step as a whole is held to 1e-5.
STEP_TOLERANCE = 1e-5
TINY_TENSOR_NUMEL = 64
TINY_TENSOR_TOLERANCE = 1e-4


def check_against_naive(fused, fused_params, naive, naive_params, shapes, steps, dtype):
    """Steps both optimizers on the same gradients; after every step the updates must agree and the
    naive side is resynchronised to the fused one. Returns the worst relative update errors."""
    worst = worst_step = 0.0
    for step in range(steps):
        set_grads(fused_params, seed=step)
        set_grads(naive_params, seed=step)
        before = [p.detach().float().clone() for p in fused_params]
        fused.step()
        naive.step()
        fused_updates = [f.detach().float() - b for f, b in zip(fused_params, before)]
        naive_updates = [n.detach().float() - b for n, b in zip(naive_params, before)]
        if dtype == torch.float32:
            step_error = relative_error(torch.cat([u.reshape(-1) for u in fused_updates]),
                                        torch.cat([u.reshape(-1) for u in naive_updates]))
            worst_step = max(worst_step, step_error)
            assert step_error <= STEP_TOLERANCE, f"step {step}: relative update error {step_error:.2e}"
            for uf, un, shape in zip(fused_updates, naive_updates, shapes):
                err = relative_error(uf, un)
                tolerance = TINY_TENSOR_TOLERANCE if uf.numel() < TINY_TENSOR_NUMEL else STEP_TOLERANCE
                if uf.numel() >= TINY_TENSOR_NUMEL:
                    worst = max(worst, err)
                assert err <= tolerance, f"step {step} shape {shape}: relative update error {err:.2e}"
        else:  # the same float32 math, rounded to the parameter dtype once
            tol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
            for f, n, shape in zip(fused_params, naive_params, shapes):
                assert torch.allclose(f.detach().float(), n.detach().float(), rtol=tol, atol=tol * 1e-2), shape
        sync_into(naive, naive_params, fused, fused_params)
    return worst_step, worst


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_matches_naive_every_rank(weights, dtype):
    shapes = ALL_SHAPES
    fused_params, naive_params = make_params(shapes, dtype), make_params(shapes, dtype)
    fused = lopt.SmallFCLOpt(fused_params, weights=weights, backend="fused", lr=0.7, weight_decay=0.01)
    naive = lopt.SmallFCLOpt(naive_params, weights=weights, backend="naive", lr=0.7, weight_decay=0.01)
    steps = 200 if dtype == torch.float32 else 20
    worst_step, worst = check_against_naive(fused, fused_params, naive, naive_params, shapes, steps, dtype)
    assert int(fused.state_dict()["param_groups"][0]["step"]) == steps
    print(f"max relative update error ({dtype}): per step {worst_step:.2e}, per tensor (>= 64 elements) {worst:.2e}")


def test_bit_identical_across_runs(weights):
    results = []
    for _ in range(2):
        params = make_params(ALL_SHAPES, torch.float32, seed=3)
        opt = lopt.SmallFCLOpt(params, weights=weights, backend="fused")
        for step in range(5):
            set_grads(params, seed=100 + step)
            opt.step()
        results.append([p.detach().clone() for p in params] + [opt.state[p]["mom"].clone() for p in params])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_cuda_graph_replay_equals_eager(weights):
    shapes = [(64, 48), (48,), (3, 5, 7), (300, 260)]
    eager_params, graph_params = make_params(shapes, torch.float32, 5), make_params(shapes, torch.float32, 5)
    eager = lopt.SmallFCLOpt(eager_params, weights=weights, backend="fused")
    graphed = lopt.SmallFCLOpt(graph_params, weights=weights, backend="fused")
    for p in graph_params:
        p.grad = torch.empty_like(p)
    static_grads = [p.grad for p in graph_params]

    def load(step):
        set_grads(eager_params, seed=step)
        for g, e in zip(static_grads, eager_params):
            g.copy_(e.grad)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(3):  # warm-up (builds the tables) outside the graph
            load(step)
            eager.step()
            graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for step in range(3, 10):
        load(step)
        eager.step()
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager_params, graph_params):
        assert torch.equal(a, b)
    # The capture itself ran no step: counters agree after 3 eager + 7 replays.
    assert int(graphed.state_dict()["param_groups"][0]["step"]) == 10 == int(eager.state_dict()["param_groups"][0]["step"])


@pytest.mark.parametrize("direction", ["fused_to_naive", "naive_to_fused"])
def test_state_dict_interchange(weights, direction, tmp_path):
    first, second = ("fused", "naive") if direction == "fused_to_naive" else ("naive", "fused")
    params = make_params(ALL_SHAPES, torch.float32, 11)
    opt = lopt.SmallFCLOpt(params, weights=weights, backend=first)
    for step in range(4):
        set_grads(params, step)
        opt.step()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    reference = [p.detach().clone() for p in params]
    reference_opt = opt
    for step in range(4, 8):
        set_grads(params, step)
        reference_opt.step()
    reference_after = [p.detach().clone() for p in params]

    saved = torch.load(tmp_path / "ckpt.pt")
    resumed_params = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    resumed = lopt.SmallFCLOpt(resumed_params, weights=weights, backend=second)
    resumed.load_state_dict(saved["opt"])
    for step in range(4, 8):
        set_grads(resumed_params, step)
        resumed.step()
    for r, a, b in zip(reference, reference_after, resumed_params):
        assert relative_error(b.detach() - r, a - r) <= 1e-5


def test_poisoned_workspaces_are_overwritten(weights):
    params = make_params(ALL_SHAPES, torch.float32, 13)
    clean = make_params(ALL_SHAPES, torch.float32, 13)
    opt = lopt.SmallFCLOpt(params, weights=weights, backend="fused")
    ref = lopt.SmallFCLOpt(clean, weights=weights, backend="fused")
    for step in range(3):
        set_grads(params, step)
        set_grads(clean, step)
        for plan in opt._fused_engine.plans.values():
            for buf in (plan.axis_partials, plan.row_table, plan.col_table, plan.stats_partials, plan.folded,
                        plan.shared_frags):
                buf.fill_(float("nan"))
        opt.step()
        ref.step()
    for a, b in zip(params, clean):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_constant_launches_per_group(weights, monkeypatch):
    counted = []
    original = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: (counted.append(a[0]), original(*a, **k)))
    for n_tensors in (3, 60):
        counted.clear()
        params = make_params([(17, 9)] * n_tensors + [(5,)] * n_tensors, torch.float32)
        opt = lopt.SmallFCLOpt(params, weights=weights, backend="fused")
        set_grads(params, 0)
        opt.step()
        assert len(counted) == 6


def test_mixed_dtypes_no_grad_and_noncontiguous(weights):
    base = torch.randn(12, 10, device="cuda")
    params = [torch.nn.Parameter(base.t()), torch.nn.Parameter(torch.randn(9, device="cuda", dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(4, 4, device="cuda", dtype=torch.float16)),
              torch.nn.Parameter(torch.randn(3, device="cuda"))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with pytest.warns(RuntimeWarning, match="not contiguous"):
        fused = lopt.SmallFCLOpt(params, weights=weights, backend="fused")
        set_grads(params, 1)
        params[3].grad = None
        fused.step()
    naive = lopt.SmallFCLOpt(twins, weights=weights, backend="naive")
    set_grads(twins, 1)
    twins[3].grad = None
    naive.step()
    assert params[3] not in fused.state and twins[3] not in naive.state
    for f, n in zip(params, twins):
        tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[f.dtype]
        assert torch.allclose(f.detach().float(), n.detach().float(), rtol=tol, atol=tol * 1e-3)


def test_fused_rejects_max_grad_norm_and_auto_falls_back(weights):
    p = [torch.nn.Parameter(torch.randn(4, 4, device="cuda"))]
    with pytest.raises(RuntimeError, match="max_grad_norm is not supported by the fused backend"):
        lopt.SmallFCLOpt(p, weights=weights, backend="fused", max_grad_norm=1.0)
    with pytest.warns(RuntimeWarning, match="naive backend"):
        opt = lopt.SmallFCLOpt(p, weights=weights, backend="auto", max_grad_norm=1.0)
    assert opt.backend == "naive"
    assert lopt.SmallFCLOpt(p, weights=weights).backend == "fused"


def test_tensor_beyond_2_pow_31_elements(weights):
    """64-bit indexing: a (2^25 + 1, 64) tensor (2^31 + 64 elements) whose rows are all equal steps
    like a (65, 64) tensor with the same row (row/column means, normaliser statistics and factored
    axes are the same, up to summation order), so rows on both sides of element 2^31 are checked
    against the small one."""
    free, _ = torch.cuda.mem_get_info()
    if free < 64 * 2**30:
        pytest.skip("needs about 60 GiB of free GPU memory")
    cols, rows = 64, 2**25 + 1
    g = torch.Generator().manual_seed(21)
    row_param = torch.randn(cols, generator=g).cuda()
    row_grads = [torch.randn(cols, generator=g).cuda() * 1e-2 for _ in range(2)]
    big = torch.nn.Parameter(row_param.expand(rows, cols).contiguous())
    small = torch.nn.Parameter(row_param.expand(cols + 1, cols).contiguous())
    assert big.numel() > 2**31
    big_opt = lopt.SmallFCLOpt([big], weights=weights, backend="fused")
    small_opt = lopt.SmallFCLOpt([small], weights=weights, backend="fused")
    for grad in row_grads:
        big.grad = grad.expand(rows, cols).contiguous()
        small.grad = grad.expand(cols + 1, cols).contiguous()
        big_opt.step()
        small_opt.step()
        big.grad = None
    expected = small[-1].detach() - row_param
    for index in (0, 2**31 // cols - 1, 2**31 // cols, rows - 1):  # first row, both sides of 2^31, last row
        assert relative_error(big[index].detach() - row_param, expected) <= 1e-5, index
    assert relative_error(big_opt.state[big]["mom"][-1], small_opt.state[small]["mom"][-1]) <= 1e-6
