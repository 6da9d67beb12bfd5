import sys, torch, lopt
sys.path.insert(0, "tests")
from fused_helpers import make_params, relative_error
WS = {"small_fc_lopt": lopt.random_weights("small_fc_lopt", seed=7), "velo": lopt.random_weights("velo", seed=8)}
shapes = [(40, 30), (25,), (3, 8, 16), (256, 64)]
def make(name, params, backend, **kw):
    if name == "velo": return lopt.VeLO(params, num_steps=50, weights=WS[name], backend=backend, **kw)
    return lopt.SmallFCLOpt(params, weights=WS[name], backend=backend, **kw)
def run(name, mag, **kw):
    f_params, n_params = make_params(shapes, seed=0), make_params(shapes, seed=0)
    f, n = make(name, f_params, "fused", **kw), make(name, n_params, "naive")
    g = torch.Generator().manual_seed(4)
    grads = [((torch.rand(p.shape, generator=g) * 2 - 1) * mag).cuda() for p in f_params]
    before = [p.detach().double().clone() for p in n_params]
    for params, opt in ((f_params, f), (n_params, n)):
        for p, gr in zip(params, grads): p.grad = gr.clone()
        opt.step(torch.tensor(2.0, device="cuda")) if name == "velo" else opt.step()
    return [relative_error(a.detach().double() - b, c.detach().double() - b) for a, c, b in zip(f_params, n_params, before)]
for name, kw in (("small_fc_lopt", {}), ("small_fc_lopt", {"precision": "fast"}), ("velo", {})):
    for mag in [1e-2, 1e15, 1e17, 1e18, 1e19, 1.8e19]:
        print(name, kw, f"{mag:8.1e}", " ".join(f"{e:9.2e}" for e in run(name, mag, **kw)), flush=True)
