import sys, torch, lopt
sys.path.insert(0, "tests"); sys.path.insert(0, "benchmarks")
from fused_helpers import make_params, relative_error
from lopt.fused.small_fc_lopt import SmallFCLOptFused
W = lopt.random_weights("small_fc_lopt", seed=7)
shapes = [(40, 30), (25,), (3, 8, 16), (256, 64)]
def run(mag, defines=(), precision="exact", dist="uniform"):
    out = []
    f_params, n_params = make_params(shapes, seed=0), make_params(shapes, seed=0)
    f = lopt.SmallFCLOpt(f_params, weights=W, backend="fused", precision=precision)
    if defines: f._fused_engine = SmallFCLOptFused(f, defines=defines)
    n = lopt.SmallFCLOpt(n_params, weights=W, backend="naive")
    g = torch.Generator().manual_seed(4)
    grads = [((torch.rand(p.shape, generator=g) * 2 - 1) * mag).cuda() for p in f_params]
    before = [p.detach().double().clone() for p in n_params]
    for params, opt in ((f_params, f), (n_params, n)):
        for p, gr in zip(params, grads): p.grad = gr.clone()
        opt.step()
    return [relative_error(a.detach().double() - b, c.detach().double() - b) for a, c, b in zip(f_params, n_params, before)]
for mag in [1e-2, 1e10, 1e15, 1e17, 1e18, 3e18, 1e19, 1.8e19]:
    print(f"{mag:8.1e}", " ".join(f"{e:9.2e}" for e in run(mag)), "| always f64:", " ".join(f"{e:9.2e}" for e in run(mag, ("SFC_FOLD_ALWAYS_FLOAT64=1",))), flush=True)
