"""lopt meta-eval: the quick suite end to end, and one evaluation run against SmallFCLOpt (ELO) on torch.nn modules."""

import json
import math
import warnings

import pytest
import torch

import lopt
from lopt.cli import main
from lopt.meta import evaluate, tasks

pytest.importorskip("sklearn", reason="the held-out suite uses scikit-learn's bundled data sets (lopt[meta])")


WINE = {"task": "mlp", "dataset": "wine", "hidden": [16], "batch_size": 16}  # (wine_mlp's quick_spec)


def _wine_reference(seed):
    """The wine MLP of ``seed``'s instance as torch.nn modules holding its initial values, and its generator at the
    point where train_population draws that instance's first batch."""
    family = tasks.build(WINE)
    generator = evaluate._seed_generator("cpu", seed)
    inst = family.sample_instances(1, generator)
    init = family.init_params(1, inst, generator)
    model = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p, value in zip(model.parameters(), init):
            p.copy_(value[0])
    return family, model, inst, generator


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("optimizer", ["small_fc_lopt", "elo"])
def test_an_evaluation_run_is_the_optimizer_training_torch_nn_modules(optimizer):
    """The learned optimizer's population run (seed 1 of the wine MLP) trains exactly as SmallFCLOpt (ELO)
    trains torch.nn.Linear layers holding the same initial values on the same batches."""
    from lopt.meta.batched import BatchedSmallFCLOpt, inner_rule

    rule = inner_rule(optimizer)
    family = tasks.build(WINE)
    weights = lopt.random_weights(rule.architecture, seed=5)

    opt = BatchedSmallFCLOpt(family.shapes(), 2, optimizer=optimizer)
    opt.network = weights.tensors["mlp"]
    steps = 12
    out = evaluate.train_population(family, opt, [1, 1], steps, "cpu")
    assert torch.equal(out["train"][:, 0], out["train"][:, 1])

    family, model, inst, generator = _wine_reference(1)
    reference = rule.front_end(model.parameters(), weights=weights, backend="naive")
    for t in range(steps):
        x, y = family.sample_batch(inst, generator)
        loss = torch.nn.functional.cross_entropy(model(x[0]), y[0])
        loss_value = loss.detach()
        assert abs(loss_value.item() - float(out["train"][t, 0])) <= 1e-5 * loss_value.item(), t
        reference.zero_grad()
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference.step()
    for p, got in zip(model.parameters(), out["params"]):
        assert float((got[0] - p.detach()).norm() / p.detach().norm()) <= 1e-5


@pytest.mark.usefixtures("single_intra_op_thread")
def test_quick_meta_eval_writes_table_json_plot_and_resumes(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["meta-eval", "random", "--quick", "--out", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "| task | horizon | optimizer |" in printed
    report = json.loads((out / "results.json").read_text())
    # --quiet still logs each run as it finishes (stderr), so a stopped process's log says what finished
    lines = captured.err.splitlines()
    assert len(lines) == 4 * len(report["tasks"]) and "| task" not in captured.err
    learned = report["tasks"][0]["summary"]["learned"]
    assert (f"{report['tasks'][0]['task']}: learned done in " in lines[1]
            and f"final training loss {learned['final_train']['mean']:.4g} (mean of 2), "
                f"{round(learned['divergence_rate'] * 2)} diverged" in lines[1]), lines[1]
    assert report["complete"] and report["settings"]["quick"]
    names = [t["task"] for t in report["tasks"]]
    assert names == [t.name for t in evaluate.SUITES["heldout-v1"]]
    for task in report["tasks"]:
        assert set(task["summary"]) == {"learned", "adamw_tuned", "adamw_default"}
        assert task["tuned_lr"] in evaluate.QUICK["lrs"]
        for summary in task["summary"].values():
            assert len(summary["runs"]) == len(evaluate.QUICK["report_seeds"])
            assert 0.0 <= summary["divergence_rate"] <= 1.0
    assert (out / "results.md").read_text().count("\n") >= 2 + 3 * len(names)
    assert (out / "curves.png").stat().st_size > 1000
    # a rerun finds every run done and reproduces the report
    before = (out / "results.md").read_text()
    assert main(["meta-eval", "random", "--quick", "--out", str(out), "--quiet"]) == 0
    assert (out / "results.md").read_text() == before
    assert capsys.readouterr().err == ""  # nothing trained, nothing logged


def test_exported_data_sets_stand_in_for_scikit_learn(tmp_path, monkeypatch):
    """`python -m lopt.meta.data export FILE` + LOPT_META_DATA=FILE: the same data sets where scikit-learn is
    missing (an offline GPU machine); without either, a clear MissingDependency."""
    import sys

    from lopt.meta import data

    path = data.export(tmp_path / "meta_data.pt")
    expected = data.digits()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails as if not installed
    with pytest.raises(data.MissingDependency, match="LOPT_META_DATA"):
        data.wine()
    monkeypatch.setenv("LOPT_META_DATA", str(path))
    got = data.digits()
    assert torch.equal(got.train_x, expected.train_x) and torch.equal(got.test_y, expected.test_y)
    assert data.breast_cancer().num_classes == 2


@pytest.mark.usefixtures("single_intra_op_thread")
def test_learned_lr_runs_the_learned_optimizer_at_another_lr_into_its_own_directory(tmp_path, capsys):
    """--learned-lr: the learned runs take that lr (the AdamW runs are the same), the table says so, and the
    default results directory is another one, so the suite's own results (lr 1) are kept."""
    weights = tmp_path / "w"
    lopt.random_weights("small_fc_lopt", seed=3).save(weights)
    common = ["meta-eval", str(weights), "--quick", "--tasks", "wine_mlp", "--quiet"]
    assert main(common) == 0
    assert main(common + ["--learned-lr", "0.1"]) == 0
    assert "| wine_mlp | 30 | learned (lr 0.1) |" in capsys.readouterr().out
    default = json.loads((weights / "eval-quick" / "results.json").read_text())["tasks"][0]
    scaled = json.loads((weights / "eval-quick-lr0.1" / "results.json").read_text())["tasks"][0]
    assert default["runs"]["learned"]["lr"] == 1.0 and scaled["runs"]["learned"]["lr"] == 0.1
    assert scaled["summary"]["adamw_tuned"] == default["summary"]["adamw_tuned"]
    assert scaled["summary"]["learned"] != default["summary"]["learned"]
    # an lr of 0.1 is the default lr's run with every update scaled by 0.1: the first step says so exactly
    family = tasks.build(evaluate.SUITES["heldout-v1"][1].quick_spec)
    from lopt.meta.batched import BatchedSmallFCLOpt

    first = {}
    for lr in (1.0, 0.1):
        opt = BatchedSmallFCLOpt(family.shapes(), 1, lr=lr)
        opt.network = lopt.load_weights(str(weights), "small_fc_lopt").tensors["mlp"]
        out = evaluate.train_population(family, opt, [2], 1, "cpu")
        generator = evaluate._seed_generator("cpu", 2)
        init = family.init_params(1, family.sample_instances(1, generator), generator)
        first[lr] = [p - p0 for p, p0 in zip(out["params"], init)]
    for big, small in zip(first[1.0], first[0.1]):
        assert torch.allclose(small, 0.1 * big, rtol=1e-5, atol=1.2e-7)  # (p - p0 rounds once: ulp(p) / 2)
    with pytest.raises(ValueError, match=r"learned_lr=nan: the learned optimizer's lr must be a finite number > 0"):
        evaluate.EvalSettings.make(learned_lr=float("nan"))
    with pytest.raises(SystemExit) as exit_info:  # (argparse's own errors exit)
        main(common + ["--learned-lr", "0"])
    assert exit_info.value.code == 2 and "--learned-lr: expected a number > 0, got '0'" in capsys.readouterr().err


@pytest.mark.usefixtures("single_intra_op_thread")
def test_baselines_share_the_adamw_runs_between_weight_sets(tmp_path, capsys, monkeypatch):
    """--baselines DIR: the first evaluation keeps its AdamW runs there; a second weight set's takes them (no AdamW
    step runs) and reports the same AdamW numbers; the learned runs are each weight set's own."""
    first, second, baselines = tmp_path / "w1", tmp_path / "w2", tmp_path / "baselines"
    lopt.random_weights("small_fc_lopt", seed=3).save(first)
    lopt.random_weights("small_fc_lopt", seed=4).save(second)
    common = ["--quick", "--tasks", "wine_mlp,breast_cancer_mlp", "--quiet", "--baselines", str(baselines)]
    assert main(["meta-eval", str(first)] + common) == 0
    kept = sorted(p.name.rsplit("-", 1)[0] for p in baselines.iterdir())
    assert kept == [f"{task}-adamw_{run}" for task in ("breast_cancer_mlp", "wine_mlp")
                    for run in ("default", "sweep", "tuned")]

    trained = []
    train_population = evaluate.train_population

    def recorded(family, optimizer, *args, **kwargs):
        trained.append(type(optimizer).__name__)
        return train_population(family, optimizer, *args, **kwargs)

    monkeypatch.setattr(evaluate, "train_population", recorded)
    assert main(["meta-eval", str(second)] + common) == 0
    assert trained == ["BatchedSmallFCLOpt", "BatchedSmallFCLOpt"]  # the learned runs only, one per task
    capsys.readouterr()
    a = json.loads((first / "eval-quick" / "results.json").read_text())["tasks"]
    b = json.loads((second / "eval-quick" / "results.json").read_text())["tasks"]
    for x, y in zip(a, b):
        assert x["summary"]["adamw_tuned"] == y["summary"]["adamw_tuned"] and x["tuned_lr"] == y["tuned_lr"]
        assert x["summary"]["adamw_default"] == y["summary"]["adamw_default"]
        assert x["summary"]["learned"] != y["summary"]["learned"]
    # other settings (a longer horizon) name other files: nothing is taken from runs that would differ
    task = evaluate.SUITES["heldout-v1"][1]
    quick = evaluate.EvalSettings.make(quick=True)
    longer = evaluate.EvalSettings.make(quick=True, horizon=31)
    assert evaluate.baseline_path(baselines, task, quick, "adamw_default", "cpu", {"lr": 1e-3}).exists()
    assert not evaluate.baseline_path(baselines, task, longer, "adamw_default", "cpu", {"lr": 1e-3}).exists()
    assert evaluate.baseline_path(baselines, task, evaluate.EvalSettings.make(quick=True, learned_lr=0.1),
                                  "adamw_default", "cpu", {"lr": 1e-3}).exists()  # (the learned lr is not AdamW's)


def _train_reference(seed, steps, make_optimizer):
    """Train ``seed``'s wine MLP for ``steps`` steps with ``make_optimizer(params)`` and torch's
    CosineAnnealingLR(T_max=steps): (losses, initial parameters, final parameters)."""
    family, model, inst, generator = _wine_reference(seed)
    init = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = make_optimizer(model.parameters())
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=0.0)
        losses = []
        for _ in range(steps):
            x, y = family.sample_batch(inst, generator)
            loss = torch.nn.functional.cross_entropy(model(x[0]), y[0])
            losses.append(loss.item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    return torch.tensor(losses), init, [p.detach() for p in model.parameters()]


def _relative(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _moved_alike(got, init, expected, member, tolerance):
    """Member ``member``'s parameters moved from ``init`` as ``expected`` did, within ``tolerance`` relative to the
    move (a schedule changes the move, not the parameters' scale)."""
    return all(_relative(g[member] - p0, e - p0) <= tolerance for g, p0, e in zip(got, init, expected))


@pytest.mark.usefixtures("single_intra_op_thread")
def test_a_cosine_scheduled_adamw_run_is_torch_adamw_under_cosine_annealing_lr():
    """A scheduled AdamW population (three members, each its own lr, two of them the same seed) trains each member
    exactly as torch.optim.AdamW under torch's CosineAnnealingLR(T_max=horizon) trains torch.nn.Linear layers
    holding the same initial values on the same batches; the lr tensor ends the run as given."""
    from lopt.meta.batched import BatchedAdamW

    family, steps, seeds = tasks.build(WINE), 12, [1, 2, 1]
    lrs = torch.tensor([3e-2, 1e-1, 1e-2])
    opt = BatchedAdamW(family.shapes(), len(seeds), lr=lrs.clone())
    out = evaluate.train_population(family, opt, seeds, steps, "cpu", lr_schedule="cosine")
    assert torch.equal(opt.lr, lrs)
    constant = evaluate.train_population(family, BatchedAdamW(family.shapes(), len(seeds), lr=lrs.clone()), seeds,
                                         steps, "cpu")
    assert torch.equal(out["train"][:2], constant["train"][:2])  # (the multiplier is 1 at step 0)
    assert not torch.equal(out["train"][-1], constant["train"][-1])  # (then smaller: the schedule acts)
    for m, (seed, lr) in enumerate(zip(seeds, lrs.tolist())):
        losses, init, params = _train_reference(seed, steps, lambda ps: torch.optim.AdamW(ps, lr=lr, foreach=False))
        assert _relative(out["train"][:, m], losses) <= 1e-6, m
        assert _moved_alike(out["params"], init, params, m, 1e-5), m


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("optimizer", ["small_fc_lopt", "elo"])
@pytest.mark.parametrize("per_member", [False, True], ids=["shared_lr", "lr_per_member"])
def test_a_cosine_scheduled_learned_run_is_the_optimizer_under_cosine_annealing_lr(optimizer, per_member):
    """The learned optimizer's scheduled population run (its lr a 0-d tensor shared by the members, or one per
    member) trains each member as SmallFCLOpt (ELO), backend naive, whose group lr torch's CosineAnnealingLR
    sets after every step, trains torch.nn.Linear layers holding the same initial values on the same batches."""
    from lopt.meta.batched import BatchedSmallFCLOpt, inner_rule

    rule = inner_rule(optimizer)
    weights = lopt.random_weights(rule.architecture, seed=5)
    family, steps, seeds = tasks.build(WINE), 12, [1, 2]
    base = rule.defaults["lr"]
    lrs = [base, 0.3 * base] if per_member else [base, base]
    lr = torch.tensor(lrs) if per_member else torch.tensor(base)
    opt = BatchedSmallFCLOpt(family.shapes(), len(seeds), optimizer=optimizer, lr=lr)
    opt.network = weights.tensors["mlp"]
    out = evaluate.train_population(family, opt, seeds, steps, "cpu", lr_schedule="cosine")
    assert torch.equal(opt.lr, torch.tensor(lrs) if per_member else torch.tensor(base))
    for m, (seed, lr_m) in enumerate(zip(seeds, lrs)):
        losses, init, params = _train_reference(
            seed, steps, lambda ps: rule.front_end(ps, lr=lr_m, weights=weights, backend="naive"))
        assert _relative(out["train"][:, m], losses) <= 1e-6, m
        assert _moved_alike(out["params"], init, params, m, 1e-5), m


@pytest.mark.usefixtures("single_intra_op_thread")
def test_scheduled_runs_through_the_emulated_graph_path_are_the_eager_runs_bit_for_bit(monkeypatch):
    """The CUDA-graph path emulated on the CPU (warm-up, then 'replays' on static tensors that check no tensor the
    graph reads was replaced, the optimizer's lr included) gives the eager path's scheduled losses and parameters
    bit for bit; an lr replaced between steps instead of written in place is caught there (a captured graph would
    keep reading the first one)."""
    from lopt.meta import stepper
    from lopt.meta.batched import BatchedAdamW, BatchedSmallFCLOpt

    family = tasks.build(WINE)
    network = lopt.random_weights("small_fc_lopt", seed=5).tensors["mlp"]

    def runs():
        out = []
        for make in (lambda: BatchedAdamW(family.shapes(), 3, lr=torch.tensor([1e-3, 1e-2, 1e-1])),
                     lambda: BatchedSmallFCLOpt(family.shapes(), 3, lr=torch.tensor(1.0))):
            opt = make()
            opt.network = network
            run = evaluate.train_population(family, opt, [0, 1, 1], 10, "cpu", lr_schedule="cosine")
            out.append((run["train"], run["params"], run["graph_steps"]))
        return out

    eager = runs()
    monkeypatch.setattr(stepper, "EMULATE_ON_CPU", True)
    emulated = runs()
    for (train_a, params_a, graph_a), (train_b, params_b, graph_b) in zip(eager, emulated):
        assert graph_a == 0 and graph_b == 10 - stepper.PopulationStepper.WARMUP
        assert torch.equal(train_a, train_b)
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))

    opt = BatchedAdamW(family.shapes(), 2, lr=torch.tensor([1e-3, 1e-2]))
    calls = []

    def replace_lr():  # what a schedule must not do: a new tensor, which a captured graph never reads
        calls.append(None)
        if len(calls) == 5:
            opt.lr = opt.lr.clone()

    with pytest.raises(AssertionError, match="replaced a tensor a captured graph reads"):
        evaluate.train_population(family, opt, [0, 1], 10, "cpu", on_step=replace_lr, lr_schedule="cosine")


def test_the_schedule_setting_keys_its_runs_apart_and_refuses_unknown_names(capsys):
    """schedule='constant' leaves the key (so every kept run and baseline of the suite's protocol) as it was; a
    cosine run is keyed and kept apart; an unknown schedule, a number lr or an lr on another device is refused."""
    from lopt.meta.batched import BatchedAdamW

    quick = evaluate.EvalSettings.make(quick=True)
    assert quick.schedule == "constant" and "schedule" not in quick.key()
    assert quick.key() == {"suite": "heldout-v1", "horizon": 30, "lrs": [1e-3, 1e-2, 1e-1], "tune_seeds": [0],
                           "report_seeds": [1, 2], "quick": True}
    cosine = evaluate.EvalSettings.make(quick=True, schedule="cosine")
    assert cosine.key() == {**quick.key(), "schedule": "cosine"}
    assert set(evaluate.SCHEDULES) == {"constant", "cosine"}
    task = evaluate.SUITES["heldout-v1"][1]
    for name, extra in (("adamw_sweep", {"lrs": [1e-3]}), ("adamw_default", {"lr": 1e-3})):
        paths = [evaluate.baseline_path("b", task, s, name, "cpu", extra) for s in (quick, cosine)]
        assert paths[0] != paths[1] and paths[0].name.startswith(f"wine_mlp-{name}-")
    with pytest.raises(ValueError, match=r"schedule='linear': choose one of constant, cosine"):
        evaluate.EvalSettings.make(schedule="linear")
    family = tasks.build(WINE)
    with pytest.raises(ValueError, match=r"lr_schedule='linear': choose one of constant, cosine \(or None\)"):
        evaluate.train_population(family, BatchedAdamW(family.shapes(), 1, lr=torch.tensor([1e-3])), [0], 2, "cpu",
                                  lr_schedule="linear")
    with pytest.raises(TypeError, match=r"BatchedAdamW.lr must be a floating-point tensor its step reads .*got 0.001"):
        evaluate.train_population(family, BatchedAdamW(family.shapes(), 1, lr=1e-3), [0], 2, "cpu",
                                  lr_schedule="cosine")
    opt = BatchedAdamW(family.shapes(), 1, lr=torch.tensor([1e-3]))
    opt.lr = torch.tensor([1e-3], device="meta")
    with pytest.raises(ValueError, match=r"BatchedAdamW.lr on the population's device cpu, got a tensor on meta"):
        evaluate.train_population(family, opt, [0], 2, "cpu", lr_schedule="cosine")
    with pytest.raises(SystemExit) as exit_info:  # (argparse's own errors exit)
        main(["meta-eval", "random", "--quick", "--schedule", "linear"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # (Python 3.12 quotes the choices, 3.11 does not)
    assert "argument --schedule: invalid choice: 'linear' (choose from " in err and "cosine" in err


@pytest.mark.usefixtures("single_intra_op_thread")
def test_schedule_cosine_evaluates_every_optimizer_scheduled_into_its_own_directory(tmp_path, capsys, monkeypatch):
    """--schedule cosine: results in WEIGHTS/eval-quick-cosine beside the protocol's WEIGHTS/eval-quick, every run
    recorded as scheduled, the header and every row saying so; its AdamW runs (the sweep included) are its own, kept
    apart from the constant protocol's in --baselines, and shared with another cosine evaluation (here
    --learned-backend naive, WEIGHTS/eval-quick-cosine-naive, whose scheduled members agree with the batched step)."""
    weights, baselines = tmp_path / "w", tmp_path / "baselines"
    lopt.random_weights("small_fc_lopt", seed=3).save(weights)
    common = ["meta-eval", str(weights), "--quick", "--tasks", "wine_mlp", "--quiet", "--baselines", str(baselines)]
    assert main(common) == 0
    assert main(common + ["--schedule", "cosine"]) == 0
    printed = capsys.readouterr().out
    assert "Cosine schedule: every optimizer's lr (the learned one's, AdamW's, the sweep's) is multiplied at step t " \
           "by ½(1 + cos(π t / horizon))" in printed
    assert "| wine_mlp | 30 | learned (lr 1, cosine) |" in printed
    assert "| wine_mlp | 30 | AdamW tuned (lr " in printed and ", cosine) |" in printed
    assert "| wine_mlp | 30 | AdamW 1e-3 (cosine) |" in printed
    assert "Cosine schedule" in (weights / "eval-quick-cosine" / "results.md").read_text()
    constant = json.loads((weights / "eval-quick" / "results.json").read_text())
    cosine = json.loads((weights / "eval-quick-cosine" / "results.json").read_text())
    assert "schedule" not in constant["settings"] and cosine["settings"]["schedule"] == "cosine"
    assert "schedule" not in constant["tasks"][0] and cosine["tasks"][0]["schedule"] == "cosine"
    for name in ("adamw_sweep", "learned", "adamw_default", "adamw_tuned"):
        assert "schedule" not in constant["tasks"][0]["runs"][name]
        assert cosine["tasks"][0]["runs"][name]["schedule"] == "cosine"
        assert cosine["tasks"][0]["runs"][name]["summaries"] != constant["tasks"][0]["runs"][name]["summaries"], name
    assert cosine["tasks"][0]["runs"]["learned"]["lr"] == 1.0  # (the lr as given, recorded as a number)
    assert len(list(baselines.iterdir())) == 6  # three AdamW runs per protocol

    trained = []
    train_population = evaluate.train_population

    def recorded(family, optimizer, *args, **kwargs):
        trained.append((type(optimizer).__name__, kwargs.get("lr_schedule")))
        return train_population(family, optimizer, *args, **kwargs)

    monkeypatch.setattr(evaluate, "train_population", recorded)
    assert main(common + ["--schedule", "cosine", "--learned-backend", "naive"]) == 0
    assert trained == [("MemberOptimizers", "cosine")]  # the AdamW runs were the first cosine evaluation's
    assert "| wine_mlp | 30 | learned (lr 1, naive step, cosine) |" in capsys.readouterr().out
    members = json.loads((weights / "eval-quick-cosine-naive" / "results.json").read_text())
    a = members["tasks"][0]["summary"]["learned"]["final_train"]["mean"]
    b = cosine["tasks"][0]["summary"]["learned"]["final_train"]["mean"]
    assert math.isclose(a, b, rel_tol=1e-4), (a, b)
    assert members["tasks"][0]["summary"]["adamw_tuned"] == cosine["tasks"][0]["summary"]["adamw_tuned"]
