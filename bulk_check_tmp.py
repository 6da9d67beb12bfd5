# Temporary: two fused steps with and without SFC_BULK_STATE_STORES must leave identical parameters and state.
import torch, lopt
from lopt.fused.small_fc_lopt import SmallFCLOptFused
torch.manual_seed(0)
shapes = [(1024, 4096), (4096, 1024), (1000, 33), (50257, 1024), (1024,), (7, 5, 32), (3,)]
weights = lopt.random_weights("small_fc_lopt", seed=0)
for precision in ("fast", "exact"):
    runs = []
    for defines in ((), ("SFC_BULK_STATE_STORES=1",)):
        gen = torch.Generator(device="cuda").manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02) for s in shapes]
        opt = lopt.SmallFCLOpt(params, weights=weights, backend="fused", precision=precision)
        if defines:
            opt._fused_engine = SmallFCLOptFused(opt, defines=defines)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
            opt.step()
        torch.cuda.synchronize()
        runs.append(([p.detach().clone() for p in params],
                     [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]))
    (pa, sa), (pb, sb) = runs
    same_params = all(torch.equal(a, b) for a, b in zip(pa, pb))
    same_state = all(torch.equal(a[k], b[k]) for a, b in zip(sa, sb) for k in a)
    print(f"bulk state stores, {precision}: parameters identical {same_params}, state identical {same_state}")
