"""lopt.meta.members: a population stepped by one lopt optimizer per member (``lopt meta-eval --learned-backend``),
against the batched step it stands in for, and on a GPU with the fused backend."""

import math

import pytest
import torch

import lopt
from lopt.meta import batched, evaluate, rules, stepper, tasks
from lopt.meta.members import MemberOptimizers

SHAPES = [(5,), (4, 6), (6, 4), (2, 3, 4), (), (8, 3, 3, 3)]
TEACHER = {"task": "teacher_student", "in_dim": 4, "out_dim": 2, "teacher_hidden": [8], "student_hidden": [8, 8],
           "batch_size": 8}
CNN = {"task": "cnn", "dataset": "digits", "channels": [4], "batch_size": 8}


def _max_relative(a_list, b_list):
    return max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(a_list, b_list))


def _batched(shapes, population, device, weights, optimizer="small_fc_lopt", lr=None):
    opt = rules.batched_optimizer(shapes, population, device, optimizer=optimizer, lr=lr)
    opt.network = {k: v.to(device) for k, v in weights.tensors["mlp"].items()}
    return opt


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("optimizer", rules.TRAINABLE)
def test_member_optimizers_step_as_the_batched_step(optimizer):
    """Three members (random parameters and gradients of every rank, 6 steps, lr 0.3): each member's naive optimizer
    over views of the population tensors gives the batched step's parameters; a member whose gradient holds a NaN
    at step 3 changes nothing that step while the others step, as the batched step's per-member skip does."""
    population, steps = 3, 6
    weights = lopt.random_weights(rules.inner_rule(optimizer).architecture, seed=3)
    generator = torch.Generator().manual_seed(0)
    init = [torch.randn((population,) + s, generator=generator) for s in SHAPES]
    grads = [[torch.randn((population,) + s, generator=generator) * 10.0 ** (i % 3 - 1) for i, s in enumerate(SHAPES)]
             for _ in range(steps)]
    grads[2][1][1, 0, 0] = float("nan")

    reference = _batched(SHAPES, population, "cpu", weights, optimizer, lr=0.3)
    state = reference.init_state()
    expected = [p.clone() for p in init]
    members = MemberOptimizers(population, optimizer=optimizer, weights=weights, lr=0.3, backend="naive")
    params = [p.clone() for p in init]
    storage = [p.data_ptr() for p in params]
    for t in range(steps):
        before = [p.clone() for p in params]
        expected = reference.step(expected, grads[t], state, reference.network)
        new = members.step([p.detach().requires_grad_(True) for p in params], grads[t], members.init_state())
        for p, value in zip(params, new):
            p.copy_(value)
        assert [p.data_ptr() for p in params] == storage
        assert _max_relative(params, expected) <= 1e-5, f"step {t + 1}"
        if t == 2:
            assert all(torch.equal(p[1], b[1]) for p, b in zip(params, before)), "member 1 stepped on a NaN gradient"
            assert not torch.equal(params[0][0], before[0][0])
    assert members.backends == ["naive"] * population
    assert [int(o.param_groups[0]["step"]) for o in members.optimizers] == [steps, steps - 1, steps]
    assert all(p.grad is None for views in members._views for p in views)


@pytest.mark.usefixtures("single_intra_op_thread")
def test_a_population_trained_by_member_optimizers_is_the_batched_population(monkeypatch):
    """train_population (meta-eval's runs) with MemberOptimizers gives the batched step's training curves, eager and
    through the emulated CUDA-graph path (which checks that no tensor a graph reads is replaced)."""
    family = tasks.build(TEACHER)
    weights = lopt.weights.load_weights("lopt-small_fc-tiny", "small_fc_lopt")
    expected = evaluate.train_population(family, _batched(family.shapes(), 3, "cpu", weights), [2, 3, 3], 20, "cpu")
    for emulate in (False, True):
        monkeypatch.setattr(stepper, "EMULATE_ON_CPU", emulate)
        members = MemberOptimizers(3, weights=weights, backend="naive")
        run = evaluate.train_population(family, members, [2, 3, 3], 20, "cpu")
        assert (run["graph_steps"] > 0) == emulate
        assert float((run["train"] - expected["train"]).abs().max()) <= 1e-5
        assert _max_relative(run["params"], expected["params"]) <= 1e-5
        assert torch.equal(run["params"][0][1], run["params"][0][2])  # the same seed, the same run


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("optimizer", rules.TRAINABLE)
def test_scheduled_member_optimizers_are_the_scheduled_batched_population(optimizer, monkeypatch):
    """A cosine-scheduled population (meta-eval --schedule cosine --learned-backend naive): one optimizer per member,
    all sharing one 0-d lr tensor that train_population writes in place, gives the scheduled batched step's curves
    and parameters, eager and through the emulated CUDA-graph path (bit for bit between those two); the schedule
    acts (the constant run differs), and the shared lr ends the run as given."""
    family = tasks.build(TEACHER)
    rule = rules.inner_rule(optimizer)
    weights = lopt.random_weights(rule.architecture, seed=3)
    base = rule.defaults["lr"]
    expected = evaluate.train_population(family, _batched(family.shapes(), 3, "cpu", weights, optimizer,
                                                          lr=torch.tensor(base)), [2, 3, 3], 20, "cpu",
                                         lr_schedule="cosine")
    constant = evaluate.train_population(family, _batched(family.shapes(), 3, "cpu", weights, optimizer), [2, 3, 3],
                                         20, "cpu")
    assert _max_relative(expected["params"], constant["params"]) > 1e-3
    runs = []
    for emulate in (False, True):
        monkeypatch.setattr(stepper, "EMULATE_ON_CPU", emulate)
        lr = torch.tensor(base)
        members = MemberOptimizers(3, optimizer=optimizer, weights=weights, lr=lr, backend="naive")
        run = evaluate.train_population(family, members, [2, 3, 3], 20, "cpu", lr_schedule="cosine")
        assert all(group["lr"] is lr for o in members.optimizers for group in o.param_groups)
        assert torch.equal(lr, torch.tensor(base))
        assert (run["graph_steps"] > 0) == emulate
        assert float((run["train"] - expected["train"]).abs().max()) <= 1e-5
        assert _max_relative(run["params"], expected["params"]) <= 1e-5
        runs.append(run)
    assert torch.equal(runs[0]["train"], runs[1]["train"])
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"]))
    with pytest.raises(TypeError, match=r"MemberOptimizers.lr must be a floating-point tensor .* got 1.0"):
        evaluate.train_population(family, MemberOptimizers(3, weights=weights, lr=1.0, backend="naive"), [2, 3, 3],
                                  2, "cpu", lr_schedule="cosine")


def test_member_optimizers_refuse_bad_arguments_with_the_fix():
    weights = lopt.weights.load_weights("lopt-small_fc-tiny", "small_fc_lopt")
    with pytest.raises(ValueError, match=r"backend='cuda'; choose one of auto, naive, fused"):
        MemberOptimizers(2, weights=weights, backend="cuda")
    with pytest.raises(ValueError, match=r"'velo' is registered, but its step .* is not batched"):
        MemberOptimizers(2, optimizer="velo", weights=weights)
    members = MemberOptimizers(2, weights=weights, backend="naive")
    params = [torch.randn(3, 4)]
    with pytest.raises(ValueError, match=r"each of a population of 2 on its first axis"):
        members.step(params, [torch.randn(3, 4)], {})
    assert members.optimizers is None  # nothing was built
    with pytest.raises(ValueError, match=r"learned_backend='gpu': choose one of auto, naive, fused"):
        evaluate.EvalSettings.make(learned_backend="gpu")


def test_meta_eval_learned_backend_keeps_its_runs_apart_and_names_the_step(tmp_path, capsys):
    """--learned-backend: results in WEIGHTS/eval[-quick]-BACKEND, the runs keyed apart from the batched step's, the table
    names the step that ran; the learned numbers agree with the batched evaluation's."""
    from lopt.cli import main

    weights_dir = tmp_path / "w"
    lopt.weights.load_weights("lopt-small_fc-tiny", "small_fc_lopt").save(weights_dir)
    args = ["meta-eval", str(weights_dir), "--quick", "--tasks", "wine_mlp", "--device", "cpu", "--quiet"]
    assert main(args) == 0
    batched_out = capsys.readouterr().out
    assert main(args + ["--learned-backend", "naive"]) == 0
    out = capsys.readouterr().out
    assert "| wine_mlp | 30 | learned (lr 1, naive step) |" in out
    assert (weights_dir / "eval-quick-naive" / "results.json").exists() and (weights_dir / "eval-quick" / "results.json").exists()
    import json

    members = json.loads((weights_dir / "eval-quick-naive" / "results.json").read_text())
    plain = json.loads((weights_dir / "eval-quick" / "results.json").read_text())
    assert members["settings"]["learned_backend"] == "naive" and "learned_backend" not in plain["settings"]
    a = members["tasks"][0]["summary"]["learned"]["final_train"]["mean"]
    b = plain["tasks"][0]["summary"]["learned"]["final_train"]["mean"]
    assert math.isclose(a, b, rel_tol=1e-4), (a, b)
    assert members["tasks"][0]["runs"]["learned"]["backends"] == ["naive", "naive"]
    assert "learned (lr 1) |" in batched_out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("optimizer", rules.TRAINABLE)
def test_fused_member_optimizers_on_a_gpu_follow_the_batched_step(optimizer):
    """On a GPU: one fused optimizer per member, replayed from a captured CUDA graph, against the batched step (its
    own graph) on a digits CNN and a teacher–student MLP: parameters within 1e-4 after 30 steps (the fused step
    is within float32 rounding of the naive one, and training compounds it), the same curves within 1e-3."""
    # (the shipped set is small_fc_lopt's; ELO's architecture takes its own weights: random ones, at its small lr)
    weights = (lopt.weights.load_weights("lopt-small_fc-tiny", "small_fc_lopt") if optimizer == "small_fc_lopt"
               else lopt.random_weights(rules.inner_rule(optimizer).architecture, seed=3))
    lr = 1.0 if optimizer == "small_fc_lopt" else 1e-3
    for spec in (CNN, TEACHER):
        family = tasks.build(spec).to("cuda")
        expected = evaluate.train_population(family, _batched(family.shapes(), 3, "cuda", weights, optimizer, lr),
                                             [2, 3, 4], 30, "cuda")
        members = MemberOptimizers(3, optimizer=optimizer, weights=weights, lr=lr, backend="fused")
        run = evaluate.train_population(family, members, [2, 3, 4], 30, "cuda")
        assert members.backends == ["fused"] * 3
        assert run["graph_steps"] > 0, "the fused members' steps were not replayed from a graph"
        assert _max_relative(run["params"], expected["params"]) <= 1e-4
        assert float((run["train"] - expected["train"]).abs().max()) <= 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scheduled_runs_replayed_from_a_cuda_graph_follow_the_schedule():
    """On a GPU: cosine-scheduled runs replayed from a captured CUDA graph (BatchedAdamW with an lr per member, the
    batched step and fused members with a shared 0-d lr, each a CUDA tensor written in place between replays) give
    what the same runs stepped eagerly give; a graph that kept its first lr would give the constant run instead,
    which is far from them."""
    weights = lopt.weights.load_weights("lopt-small_fc-tiny", "small_fc_lopt")
    family = tasks.build(TEACHER).to("cuda")
    shapes = family.shapes()
    makes = {
        "BatchedAdamW": lambda: batched.BatchedAdamW(shapes, 3, "cuda", lr=torch.tensor([1e-3, 1e-2, 1e-1],
                                                                                         device="cuda")),
        "BatchedSmallFCLOpt": lambda: _batched(shapes, 3, "cuda", weights, lr=torch.tensor(1.0, device="cuda")),
        "fused members": lambda: MemberOptimizers(3, weights=weights, lr=torch.tensor(1.0, device="cuda"),
                                                  backend="fused"),
    }
    for name, make in makes.items():
        graph = evaluate.train_population(family, make(), [2, 3, 4], 30, "cuda", lr_schedule="cosine")
        eager = evaluate.train_population(family, make(), [2, 3, 4], 30, "cuda", use_graph=False,
                                          lr_schedule="cosine")
        constant = evaluate.train_population(family, make(), [2, 3, 4], 30, "cuda", use_graph=False)
        assert graph["graph_steps"] > 0, name
        assert _max_relative(graph["params"], eager["params"]) <= 1e-5, name
        assert float((graph["train"] - eager["train"]).abs().max()) <= 1e-5, name
        assert _max_relative(constant["params"], eager["params"]) > 1e-3, name
