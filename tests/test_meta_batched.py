"""lopt.meta's population-batched optimizers against the real ones, member by member."""

import warnings

import pytest
import torch

import lopt
from lopt.meta import batched, rules
from lopt.meta.batched_celo2 import BatchedCELO2
from lopt.meta.metaparams import MetaParamSpace

SHAPES = [(5,), (4, 6), (6, 4), (5, 5), (2, 3, 4), (), (1, 7), (8, 3, 3, 3), (1,)]


def _relative(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("optimizer", rules.TRAINABLE)
def test_one_member_of_the_batched_step_is_the_optimizer(optimizer):
    """Every member, with its own meta-weights, steps exactly as its optimizer (SmallFCLOpt, ELO, CELO2, ELO-CELO2)
    with backend="naive" and those weights: 6 steps, every rank, a member that skips a step on a NaN gradient
    (its step count lags)."""
    population, steps = 3, 6
    rule = rules.inner_rule(optimizer)
    # CELO2's Newton–Schulz amplifies the float32 rounding of products batched over the members (another
    # summation order than one member's): up to 2.5e-5 here, where the naive step's own update moves by up to
    # 2.4e-5 when its gradients move by one ulp (measured on these shapes, 6 steps): the one-ulp yardstick of
    # docs/celo2.md §8.1; the updates below are compared after 6 steps of such drift, hence the margin
    tolerance = 1e-4 if rule.architecture == "celo2" else 1e-6
    space = MetaParamSpace(rule.architecture)
    thetas = torch.stack([space.flatten(lopt.random_weights(rule.architecture, seed=s)) for s in range(population)])
    generator = torch.Generator().manual_seed(0)
    init = [torch.randn((population,) + s, generator=generator) for s in SHAPES]
    grads = [[torch.randn((population,) + s, generator=generator) * 10.0 ** (i % 3 - 1) for i, s in enumerate(SHAPES)]
             for _ in range(steps)]
    grads[2][1][1, 0, 0] = float("nan")  # member 1 skips step 3 (all its tensors)

    opt = rules.batched_optimizer(SHAPES, population, optimizer=optimizer)
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
        opt_m = rule.front_end(reference, weights=weights, backend="naive")
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
                if update_ref.norm() == 0:  # a skipped step: the member's parameters unchanged, bit for bit
                    assert torch.equal(got, history[t - 1][i][m] if t else init[i][m]), (m, t, SHAPES[i])
                else:
                    assert _relative(update_got, update_ref) <= tolerance, (m, t, SHAPES[i])
                assert _relative(got, p.detach()) <= tolerance
            previous = [p.detach().clone() for p in reference]
            # the state too (one example buffer per tensor)
        for i, p in enumerate(reference):
            ref_state = opt_m.state[p]
            assert set(state["tensors"][i]) == set(ref_state) - {"adam_step"}, SHAPES[i]
            for name, buf in state["tensors"][i].items():
                if buf.numel():
                    got = buf[m].reshape(ref_state[name].shape)
                    assert _relative(got, ref_state[name]) <= tolerance, (name, SHAPES[i])


def test_each_trainable_optimizer_steps_with_its_own_defaults_and_the_others_are_refused_by_name():
    small_fc, elo = batched.BatchedSmallFCLOpt([(3,)], 2), batched.BatchedSmallFCLOpt([(3,)], 2, optimizer="elo")
    assert (small_fc.lr, small_fc.step_mult, elo.lr, elo.step_mult) == (1.0, 0.01, 1e-3, 1.0)
    assert torch.equal(elo.decays.momentum, torch.tensor([0.9, 0.99, 0.999]))  # ELO's decays, used as given
    with pytest.raises(ValueError, match="elo has no step_mult"):
        batched.BatchedSmallFCLOpt([(3,)], 2, optimizer="elo", step_mult=0.01)
    with pytest.raises(ValueError, match=r"populations of small_fc_lopt, elo, celo2, elo_celo2 only .*'velo' is "
                                         r"registered, but its step \(an LSTM"):
        rules.inner_rule("velo")
    with pytest.raises(ValueError, match=r"'adamw' is not a registered optimizer \(registered: small_fc_lopt, "):
        rules.batched_optimizer([(3,)], 2, optimizer="adamw")
    assert set(rules.TRAINABLE) | set(rules.NOT_BATCHED) == set(lopt.registry.names())
    celo2, elo_celo2 = BatchedCELO2([(3,)], 2), rules.batched_optimizer([(3,)], 2, optimizer="elo_celo2")
    assert (celo2.lr, celo2.weight_decay, celo2.settings["max_grad_norm"], celo2.own_adam_moments) == (1e-3, 0.0, None, True)
    assert (elo_celo2.weight_decay, elo_celo2.settings["max_grad_norm"], elo_celo2.own_adam_moments) == (0.1, 1.0, False)
    assert elo_celo2.settings["adam_weight_decay"] == 0.1  # None: the constructor's weight_decay, as the class
    with pytest.raises(ValueError, match="BatchedCELO2: ELO_CELO2 takes no adam_betas, step_mult"):
        BatchedCELO2([(3,)], 2, optimizer="elo_celo2", adam_betas=(0.9, 0.99), step_mult=0.01)


@pytest.mark.usefixtures("single_intra_op_thread")
def test_compiled_batched_step_is_the_eager_step():
    """compile_inner: the batched step through torch.compile (one graph, inductor) computes the eager step's
    parameters, state and step counts within float32 rounding: 5 steps of every kind of tensor, per-member
    networks, a member that skips a step on a NaN gradient."""
    population, shapes = 3, [(4, 6), (6,), (), (2, 3, 4)]
    space = MetaParamSpace("small_fc_lopt")
    network = space.unflatten(torch.stack([space.flatten(lopt.random_weights("small_fc_lopt", seed=s))
                                           for s in range(population)]))
    generator = torch.Generator().manual_seed(2)
    init = [torch.randn((population,) + s, generator=generator) for s in shapes]
    grads = [[torch.randn((population,) + s, generator=generator) for s in shapes] for _ in range(5)]
    grads[2][0][2, 1, 1] = float("nan")
    runs = []
    for compiled in (False, True):
        opt = batched.BatchedSmallFCLOpt(shapes, population, compiled=compiled)
        state, params, history = opt.init_state(), [p.clone() for p in init], []
        for g in grads:
            params = opt.step(params, g, state, network)
            history.append([p.clone() for p in params])
        runs.append((history, state))
    (eager, eager_state), (compiled, compiled_state) = runs
    assert compiled_state["step"].tolist() == eager_state["step"].tolist() == [5, 5, 4]
    for t, (a, b) in enumerate(zip(compiled, eager)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert _relative(x - init[i], y - init[i]) <= 1e-6, (t, shapes[i])
    for a, b in zip(compiled_state["tensors"], eager_state["tensors"]):
        for name in a:
            if a[name].numel():
                assert _relative(a[name], b[name]) <= 1e-6, name


def test_a_compiler_failure_falls_back_to_the_eager_step():
    """compile_inner where the compiler fails on the graph (torch 2.11's inductor does on the GPU for some task
    families): a warning naming the failure, the step taken eagerly with the eager step's result, nothing
    half-applied, and every later step eager without another attempt."""
    population, shapes = 2, [(3, 4), (4,)]
    network = lopt.random_weights("small_fc_lopt").tensors["mlp"]
    generator = torch.Generator().manual_seed(3)
    init = [torch.randn((population,) + s, generator=generator) for s in shapes]
    grads = [torch.randn((population,) + s, generator=generator) for s in shapes]
    eager = batched.BatchedSmallFCLOpt(shapes, population)
    eager_state = eager.init_state()
    expected = eager.step([p.clone() for p in init], grads, eager_state, network)
    opt = batched.BatchedSmallFCLOpt(shapes, population, compiled=True)
    attempts = []

    def failing_compile(*args):
        attempts.append(1)
        raise torch._dynamo.exc.BackendCompilerFailed("inductor", TypeError("CantSplit.__init__() missing 2 "
                                                                            "required positional arguments"), None)

    opt._compiled_step = failing_compile
    state = opt.init_state()
    with pytest.warns(RuntimeWarning, match=r"torch.compile of the batched optimizer's step failed "
                                            r"\(BackendCompilerFailed: TypeError: CantSplit.*\); stepping eagerly"):
        params = opt.step([p.clone() for p in init], grads, state, network)
    assert opt._compiled_step is None and "CantSplit" in opt.compile_failure
    for a, b in zip(params, expected):
        assert torch.equal(a, b)
    assert state["step"].tolist() == eager_state["step"].tolist() == [1, 1]
    for a, b in zip(state["tensors"], eager_state["tensors"]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    opt.step(params, grads, state, network)
    assert len(attempts) == 1


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


def _max_relative(a_list, b_list):
    return max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(a_list, b_list))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_steps_equal_eager_steps():
    """On a GPU: PES truncations (with resets between them) and meta-eval runs replayed from captured CUDA
    graphs give what the same steps run eagerly give."""
    from lopt.meta import evaluate, tasks
    from lopt.meta.estimators import TruncatedPES

    space = MetaParamSpace("small_fc_lopt")
    theta = space.flatten(lopt.random_weights("small_fc_lopt", seed=4))
    family_spec = {"task": "mlp", "dataset": "mnist1d", "hidden": [16], "batch_size": 16, "rescale": [0.1, 10.0]}
    results = {}
    for device, graph in (("cuda", True), ("cuda", False), ("cpu", False)):
        family = tasks.build(family_spec).to(device)
        pes = TruncatedPES(family, space, num_tasks=3, truncation=8, min_unroll=8, max_unroll=24, device=device,
                           use_graph=graph)
        host = torch.Generator().manual_seed(0)
        dev = torch.Generator(device=device).manual_seed(1)
        pes.start(host, dev)
        grads = [pes.estimate(theta.to(device), host, dev)["grad"].cpu() for _ in range(4)]
        results[(device, graph)] = (grads, [p.cpu() for p in pes.inner.params])
        if graph:
            assert pes.inner.stepper.graph_steps > 0, "the steps were not replayed from a graph"
    graph, eager, cpu = results[("cuda", True)], results[("cuda", False)], results[("cpu", False)]
    assert _max_relative(graph[1], eager[1]) <= 1e-6
    assert _max_relative(graph[0], eager[0]) <= 1e-5
    # (the CPU run draws its noise from the CPU generator, whose stream is not CUDA's: it is checked only to
    # run the same steps to finite parameters of the same shapes; the H200 showed 1.44 relative apart)
    assert [p.shape for p in eager[1]] == [p.shape for p in cpu[1]]
    assert all(bool(torch.isfinite(p).all()) for p in eager[1] + cpu[1])

    family = tasks.build({"task": "cnn", "dataset": "digits", "channels": [4], "batch_size": 8}).to("cuda")
    shapes = family.shapes()
    # (CELO2 and ELO-CELO2: Newton–Schulz on the 3x3 kernels and the matrices, ELO-CELO2's global clipping, inside
    # the graph; an lr of 0.03 so that 12 steps move the parameters)
    for make in (lambda: batched.BatchedAdamW(shapes, 3, "cuda", lr=torch.tensor([1e-3, 1e-2, 1e-1])),
                 lambda: _learned(shapes), lambda: _learned(shapes, "celo2", 0.03),
                 lambda: _learned(shapes, "elo_celo2", 0.03)):
        runs = [evaluate.train_population(family, make(), [0, 1, 1], 12, "cuda", use_graph=g) for g in (True, False)]
        assert runs[0]["graph_steps"] > 0
        assert _max_relative(runs[0]["params"], runs[1]["params"]) <= 1e-6
        assert float((runs[0]["train"] - runs[1]["train"]).abs().max()) <= 1e-5


def _learned(shapes, optimizer="small_fc_lopt", lr=None):
    opt = rules.batched_optimizer(shapes, 3, "cuda", optimizer=optimizer, lr=lr)
    architecture = rules.inner_rule(optimizer).architecture
    opt.network = {k: v.cuda() for k, v in lopt.random_weights(architecture, seed=2).tensors["mlp"].items()}
    return opt


@pytest.mark.usefixtures("single_intra_op_thread")
def test_the_graph_path_keeps_every_tensor_in_place_and_changes_nothing(monkeypatch):
    """On the CPU, the CUDA-graph path emulated (static batch and network copies, warm-up, 'replays' that run
    the step on the static tensors and check that no tensor a graph reads was replaced): PES truncations with
    resets, ES, validation and meta-eval runs give bit for bit what the eager path gives."""
    from lopt.meta import evaluate, stepper, tasks
    from lopt.meta.estimators import FullES, TruncatedPES

    space = MetaParamSpace("small_fc_lopt")
    theta = space.flatten(lopt.random_weights("small_fc_lopt", seed=4))
    spec = {"task": "mlp", "dataset": "mnist1d", "hidden": [8], "batch_size": 8, "rescale": [0.1, 10.0]}

    def pes_and_es():
        out = []
        for cls in (TruncatedPES, FullES):
            estimator = cls(tasks.build(spec), space, num_tasks=2, truncation=6, min_unroll=6, max_unroll=18,
                            use_graph=True)
            host, dev = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
            estimator.start(host, dev)
            out += [estimator.estimate(theta, host, dev)["grad"] for _ in range(5)]
            out += [p.clone() for p in estimator.inner.params]
            out.append(stepper_counts(estimator.inner.stepper))
        return out

    def evals():
        family = tasks.build({"task": "teacher_student", "in_dim": 4, "out_dim": 2, "teacher_hidden": [8],
                              "student_hidden": [8], "batch_size": 8})
        out = []
        for opt in (batched.BatchedAdamW(family.shapes(), 3, lr=torch.tensor([1e-3, 1e-2, 1e-1])),
                    batched.BatchedSmallFCLOpt(family.shapes(), 3)):
            opt.network = space.unflatten(theta)
            run = evaluate.train_population(family, opt, [0, 1, 1], 8, "cpu")
            out += [run["train"], *run["params"], (run["graph_steps"], run["eager_steps"])]
        return out

    def stepper_counts(s):
        return (s.graph_steps, s.eager_steps)

    eager = pes_and_es() + evals()
    monkeypatch.setattr(stepper, "EMULATE_ON_CPU", True)
    emulated = pes_and_es() + evals()
    for a, b in zip(eager, emulated):
        if isinstance(a, tuple):
            assert a[0] == 0 and b[0] > 0 and sum(a) == sum(b)  # eager had no replays; emulated did
        else:
            assert torch.equal(a, b)


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("options", [
    {"use_adamw_for_1d": False, "param_scale_mult": True, "exp_mult": 0.5},
    {"orthogonalize": False, "max_grad_norm": 0.5, "adam_lr_mult": 3.0, "adam_betas": (0.8, 0.9), "rms_mult": 2.0},
])
def test_celo2_options_and_a_learning_rate_per_member(options):
    """BatchedCELO2 with CELO2's other options (every vector through the learned branch, param_scale_mult,
    no Newton–Schulz, global clipping, the AdamW branch's own settings) and one lr per member, member by member
    against lopt.CELO2(backend="naive") built with the same options and that member's lr."""
    population, steps, shapes = 3, 4, [(5,), (4, 6), (), (3, 2, 2)]
    space = MetaParamSpace("celo2")
    thetas = torch.stack([space.flatten(lopt.random_weights("celo2", seed=s)) for s in range(population)])
    generator = torch.Generator().manual_seed(1)
    init = [torch.randn((population,) + s, generator=generator) for s in shapes]
    grads = [[torch.randn((population,) + s, generator=generator) for s in shapes] for _ in range(steps)]
    lrs = torch.tensor([1e-3, 3e-3, 1e-2])
    opt = BatchedCELO2(shapes, population, lr=lrs.clone(), weight_decay=0.05, **options)
    state, params = opt.init_state(), [p.clone() for p in init]
    for t in range(steps):
        params = opt.step(params, grads[t], state, space.unflatten(thetas))
    for m in range(population):
        reference = [torch.nn.Parameter(p[m].clone()) for p in init]
        opt_m = lopt.CELO2(reference, lr=float(lrs[m]), weight_decay=0.05, weights=space.to_meta_weights(thetas[m]),
                           backend="naive", **options)
        for t in range(steps):
            for p, g in zip(reference, grads[t]):
                p.grad = g[m].clone()
            opt_m.step()
        for i, p in enumerate(reference):
            moved = p.detach() - init[i][m]
            assert moved.norm() > 0
            assert _relative(params[i][m] - init[i][m], moved) <= 1e-4, (m, shapes[i])
