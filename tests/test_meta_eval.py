"""lopt meta-eval: the quick suite end to end, and one evaluation run against SmallFCLOpt (ELO) on torch.nn modules."""

import json
import warnings

import pytest
import torch

import lopt
from lopt.cli import main
from lopt.meta import evaluate, tasks

pytest.importorskip("sklearn", reason="the held-out suite uses scikit-learn's bundled data sets (lopt[meta])")


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("optimizer", ["small_fc_lopt", "elo"])
def test_an_evaluation_run_is_the_optimizer_training_torch_nn_modules(optimizer):
    """The learned optimizer's population run (seed 1 of the wine MLP) trains exactly as SmallFCLOpt (ELO)
    trains torch.nn.Linear layers holding the same initial values on the same batches."""
    from lopt.meta.batched import BatchedSmallFCLOpt, inner_rule

    rule = inner_rule(optimizer)
    family = tasks.build({"task": "mlp", "dataset": "wine", "hidden": [16], "batch_size": 16})
    weights = lopt.random_weights(rule.architecture, seed=5)

    opt = BatchedSmallFCLOpt(family.shapes(), 2, optimizer=optimizer)
    opt.network = weights.tensors["mlp"]
    steps = 12
    out = evaluate.train_population(family, opt, [1, 1], steps, "cpu")
    assert torch.equal(out["train"][:, 0], out["train"][:, 1])

    generator = evaluate._seed_generator("cpu", 1)
    inst = family.sample_instances(1, generator)
    init = family.init_params(1, inst, generator)
    model = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p, value in zip(model.parameters(), init):
            p.copy_(value[0])
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
